"""Every service's rpc latency histogram can tell 50 ms from 100 ms (the scale goal's p99 was
readable only as <= 250 ms from the buffer's own histogram)."""

from __future__ import annotations

from itertools import pairwise

from kuberl.common.server import ErrorInterceptor


def test_rpc_latency_buckets_step_at_most_one_and_a_half_times_from_1_to_100_ms() -> None:
    interceptor = ErrorInterceptor("bucketcheck")
    interceptor.latency.labels("Call").observe(0.042)
    [family] = interceptor.latency.collect()
    bounds = [
        float(s.labels["le"])
        for s in family.samples
        if s.name.endswith("_bucket") and s.labels["method"] == "Call"
    ]
    fine = [b for b in bounds if 0.001 <= b <= 0.1]
    assert fine[0] == 0.001 and fine[-1] == 0.1 and 0.05 in fine
    assert all(b / a <= 1.5 for a, b in pairwise(fine))
    assert bounds[-2:] == [600.0, float("inf")]  # a long poll still lands in a bucket
    counts = {float(s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}
    assert counts[0.04] == 0 and counts[0.05] == 1
