"""Every gRPC method of every service, fuzzed against the real processes (tests/security/cluster).

For each method of buffer, reward, rollout, trainer and weight-sync, hypothesis sends random
bytes (most do not even parse as the method's message) and generated messages with hostile
values in every field (NaN and +-inf in every float, integers at their extremes, unknown enum
values, Tensors whose dtype, shape and bytes disagree, odd strings). Every call must end in a
status a caller can act on — never INTERNAL, UNKNOWN or UNAVAILABLE — every rejection must be
counted in `kuberl_<service>_rpc_errors_total`, and every service must still be running and
SERVING afterwards. Deeper, structurally valid-but-wrong requests are in test_fuzz_semantics.py.

Two requests are left out on purpose because they are valid orders, not bad input: a Drain with
a usable timeout (the replica drains and exits, as it should) and, beyond a few examples,
CheckpointNow (each one writes a real checkpoint).
"""

from __future__ import annotations

import math
import time

import grpc
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kuberl.api.buffer.v1 import buffer_pb2
from kuberl.api.reward.v1 import reward_pb2
from kuberl.api.rollout.v1 import rollout_pb2
from kuberl.api.trainer.v1 import trainer_pb2
from kuberl.api.weight_sync.v1 import weight_sync_pb2, weight_sync_pb2_grpc
from tests.security.cluster import Cluster
from tests.security.fuzzing import (
    NEVER,
    SHORT_WAIT,
    Method,
    RawCaller,
    fuzz_settings,
    messages,
    methods,
    report,
    rpc_errors,
    uncounted,
)

C = grpc.StatusCode
METHODS = [
    *methods("reward", reward_pb2.DESCRIPTOR),
    *methods("weight_sync", weight_sync_pb2.DESCRIPTOR),
    *methods("trainer", trainer_pb2.DESCRIPTOR),
    *methods("rollout", rollout_pb2.DESCRIPTOR),
    *methods("buffer", buffer_pb2.DESCRIPTOR),
]
#: Codes a method may answer besides OK and INVALID_ARGUMENT, with why.
EXTRA_CODES: dict[str, set[grpc.StatusCode]] = {
    "buffer.LoadDataset": {C.ALREADY_EXISTS},  # a dataset name reused for another file
    "buffer.LeasePrompts": {C.RESOURCE_EXHAUSTED},  # backpressure
    "buffer.PutTrajectories": {C.ALREADY_EXISTS},  # duplicate group
    "buffer.GetBatch": {C.NOT_FOUND},  # unknown ack_batch_id
    "buffer.Ack": {C.NOT_FOUND},  # unknown batch id
    "buffer.SetPolicyVersion": {C.FAILED_PRECONDITION},  # versions only go up
    "buffer.StartEval": {C.FAILED_PRECONDITION},
    "weight_sync.ReportLoaded": {C.NOT_FOUND},  # unknown engine
    "weight_sync.Publish": {C.FAILED_PRECONDITION},  # version not above the latest
    "weight_sync.UploadSnapshot": {C.FAILED_PRECONDITION},  # version never announced
    "weight_sync.CommitPublish": {C.FAILED_PRECONDITION},
    "weight_sync.StreamSnapshot": {C.NOT_FOUND},  # no such version
    "rollout.NotifyWeightsUpdate": {C.FAILED_PRECONDITION},
    "trainer.CheckpointNow": {C.FAILED_PRECONDITION},
}
#: Fields whose hostile values are kept short or local, so a fuzz run neither sits in a long
#: poll nor makes services resolve random host names (there is no network here).
OVERRIDES = {
    "wait_seconds": SHORT_WAIT,
    "deadline_seconds": SHORT_WAIT,
    "master_address": st.sampled_from(["", "127.0.0.1", "localhost", "::1"]),
    "snapshot_endpoint": st.sampled_from(["", "127.0.0.1:1", "unix:/nonexistent"]),
    "endpoint": st.sampled_from(["", "127.0.0.1:1", "localhost:9"]),
}
#: Requests with real side effects (each CheckpointNow writes a checkpoint): at most this many.
LIMITS = {"trainer.CheckpointNow": 4}


def _allowed(method: Method) -> set[grpc.StatusCode]:
    return {C.OK, C.INVALID_ARGUMENT, *EXTRA_CODES.get(str(method), set())}


def _is_valid_order(method: Method, data: bytes) -> bool:
    """True for a Drain the replica would carry out (see the module docstring)."""
    if str(method) != "rollout.Drain":
        return False
    try:
        request = rollout_pb2.DrainRequest.FromString(data)
    except Exception:
        return False
    return math.isfinite(request.timeout_seconds) and request.timeout_seconds >= 0


def _fuzz(
    cluster: Cluster, method: Method, strategy: st.SearchStrategy, examples: int, label: str
) -> None:
    before = rpc_errors(cluster.metrics(method.service), method.service)
    allowed = _allowed(method)
    with cluster.channel(method.service) as channel:
        call = RawCaller(channel, method)

        @fuzz_settings(examples, limit=LIMITS.get(str(method)))
        @given(request=strategy)
        def run(request: object) -> None:
            data = request if isinstance(request, bytes) else request.SerializeToString()  # type: ignore[attr-defined]
            assume(not _is_valid_order(method, data))
            code = call(data)
            assert code not in NEVER and code in allowed, f"{method}: {code.name}"

        run()
    report(f"{method}:{label}", call.seen)
    after = rpc_errors(cluster.metrics(method.service), method.service)
    cluster.assert_healthy()
    assert uncounted(before, after, method.name, call.seen) == {}, dict(call.seen)


@pytest.mark.parametrize("method", METHODS, ids=str)
def test_random_bytes_get_a_status_are_counted_and_the_service_keeps_serving(
    cluster: Cluster, method: Method
) -> None:
    _fuzz(cluster, method, st.binary(max_size=96), examples=12, label="bytes")


@pytest.mark.parametrize("method", METHODS, ids=str)
def test_hostile_field_values_get_a_status_are_counted_and_the_service_keeps_serving(
    cluster: Cluster, method: Method
) -> None:
    strategy = messages(method.descriptor.input_type, overrides=OVERRIDES)
    _fuzz(cluster, method, strategy, examples=15, label="fields")


def test_every_service_still_runs_and_serves_after_all_the_fuzzing(cluster: Cluster) -> None:
    time.sleep(1.0)  # a Drain that slipped through would exit its replica 0.2 s after answering
    cluster.assert_healthy()


def test_a_huge_announced_but_never_sent_version_does_not_block_the_next_publish(
    cluster: Cluster,
) -> None:
    with cluster.channel("weight_sync") as channel:
        stub = weight_sync_pb2_grpc.WeightSyncServiceStub(channel)
        stub.Publish(
            weight_sync_pb2.PublishRequest(
                version=2**63 - 1, transports=[weight_sync_pb2.TRANSPORT_SNAPSHOT]
            ),
            timeout=10,
        )
        current = stub.GetVersion(weight_sync_pb2.GetVersionRequest(), timeout=10).version
        answer = stub.Publish(
            weight_sync_pb2.PublishRequest(
                version=current + 1, transports=[weight_sync_pb2.TRANSPORT_SNAPSHOT]
            ),
            timeout=10,
        )
    assert answer.upload_snapshot
