"""Encoding a rollout replica's PutTrajectoriesRequest: group by group against in one piece.

A replica puts the groups of one engine batch in one request: 8 groups of 8 samples of 2,048
response tokens by default, ~1.2 MB. Compared: building the request message around the groups
and serializing it in one `SerializeToString`, against serializing each group on its own and
framing them after the request's head (`kuberl.common.buffer_client.encode_put`, what replicas
do; docs/buffer.md). Both give the same message. Measured in one long-lived process, as a
replica is, in alternating rounds: CPU milliseconds and minor page faults per request, from the
groups' protos (made once) to the bytes gRPC sends. The last line printed is one JSON object.

    .venv/bin/python benchmarks/put_encoding.py [--requests 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

GROUP_SIZE = 8
GROUPS_PER_PUT = 8
RESPONSE_TOKENS = 2048
PROMPT_TOKENS = 128


def make_groups() -> list[Any]:
    """One request's groups as protos (as `Group.to_proto()` gives them to the replica)."""
    from kuberl.common.trajectory import Group, Trajectory

    rng = np.random.default_rng(0)
    groups = []
    for g in range(GROUPS_PER_PUT):
        trajectories = [
            Trajectory(
                prompt_token_ids=rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.int32),
                response_token_ids=rng.integers(0, 150_000, RESPONSE_TOKENS, dtype=np.int32),
                rollout_logprobs=-rng.random(RESPONSE_TOKENS).astype(np.float32),
                loss_mask=np.ones(RESPONSE_TOKENS, np.uint8),
                sample_index=i,
                reward=float(i % 2),
            )
            for i in range(GROUP_SIZE)
        ]
        groups.append(Group(prompt_id=f"p{g}", epoch=0, trajectories=trajectories).to_proto())
    return groups


def encoders(groups: list[Any]) -> dict[str, Callable[[], bytes]]:
    from kuberl.api.buffer.v1 import buffer_pb2 as bpb
    from kuberl.common.buffer_client import encode_put

    leases = [f"1700000000000-{i}" for i in range(len(groups))]

    def one_piece() -> bytes:  # what the replica did before
        request = bpb.PutTrajectoriesRequest(groups=groups, consumer="rollout-0", lease_ids=leases)
        return request.SerializeToString()

    def by_group() -> bytes:  # kuberl.rollout.worker now
        head = bpb.PutTrajectoriesRequest(consumer="rollout-0", lease_ids=leases)
        return encode_put(head, groups)

    return {"one_piece": one_piece, "by_group": by_group}


def measure(fn: Callable[[], bytes], requests: int) -> dict[str, float]:
    """CPU ms and minor page faults per request over `requests` calls."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = time.process_time()
    for _ in range(requests):
        fn()
    cpu = time.process_time() - cpu0
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "ms": cpu / requests * 1e3,
        "faults": (after.ru_minflt - before.ru_minflt) / requests,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (alternating)")
    args = parser.parse_args()

    from kuberl.api.buffer.v1 import buffer_pb2 as bpb

    groups = make_groups()
    fns = encoders(groups)
    encoded = {name: fn() for name, fn in fns.items()}
    parsed = {name: bpb.PutTrajectoriesRequest.FromString(b) for name, b in encoded.items()}
    if parsed["one_piece"] != parsed["by_group"]:
        raise AssertionError("the two encodings do not parse to the same request")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in fns}
    for i in range(args.rounds):
        order = list(fns) if i % 2 == 0 else list(reversed(fns))
        for name in order:
            runs[name].append(measure(fns[name], args.requests))
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("ms", "faults")}
        for name, rs in runs.items()
    }
    result = {
        "benchmark": "put_encoding",
        "groups_per_request": GROUPS_PER_PUT,
        "group_size": GROUP_SIZE,
        "response_tokens": RESPONSE_TOKENS,
        "request_bytes": len(encoded["by_group"]),
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "by_group_ms_per_request": round(med["by_group"]["ms"], 3),
        "one_piece_ms_per_request": round(med["one_piece"]["ms"], 3),
        "speedup": round(med["one_piece"]["ms"] / med["by_group"]["ms"], 2),
        "by_group_page_faults_per_request": round(med["by_group"]["faults"], 1),
        "one_piece_page_faults_per_request": round(med["one_piece"]["faults"], 1),
        "rounds_ms": {n: [round(r["ms"], 3) for r in rs] for n, rs in runs.items()},
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "libc": " ".join(platform.libc_ver()),
        },
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
