"""The reward service's gRPC front: `RewardService.Score` and `ListVerifiers`.

`kuberl serve reward` calls `create_service(config)` and runs it under the shared bootstrap
(health NOT_SERVING until the worker processes are up, the sandbox probed and the reward model
loaded). `Score` validates the whole batch first: a sample with metadata that is not a JSON
object, token ids that are not an integer tensor, an unknown finish reason or an unknown
verifier rejects the batch with INVALID_ARGUMENT naming the sample, counted in
`kuberl_reward_rejected_total`. After that the batch always succeeds: a verifier that fails gives
its sample the fallback reward and an error (see `kuberl.reward.scorer`).
"""

from __future__ import annotations

import json

import grpc

from kuberl.api.common.v1 import trajectory_pb2
from kuberl.api.reward.v1 import reward_pb2, reward_pb2_grpc
from kuberl.common import metrics
from kuberl.common.config import JobConfig
from kuberl.common.errors import InvalidArgument
from kuberl.common.server import Service
from kuberl.common.trajectory import TrajectoryError, decode_array
from kuberl.reward.sample import RewardSample
from kuberl.reward.scorer import Scorer

_rejected = metrics.counter(
    "kuberl_reward_rejected_total", "Score batches rejected as invalid, by reason", ["reason"]
)
_batch_samples = metrics.histogram(
    "kuberl_reward_batch_samples",
    "Samples per Score call",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
)


def _reject(reason: str, message: str) -> InvalidArgument:
    _rejected.labels(reason).inc()
    return InvalidArgument(message)


def _finish_reason(value: int, sample_id: str) -> str:
    if value == trajectory_pb2.FINISH_REASON_UNSPECIFIED:
        return ""
    try:
        name = trajectory_pb2.FinishReason.Name(value)
    except ValueError:
        raise _reject(
            "bad_finish_reason", f"sample {sample_id!r}: unknown finish_reason {value}"
        ) from None
    return name.removeprefix("FINISH_REASON_").lower()


#: Deeper metadata is refused: the pool wraps it in a few more levels on its way to a worker, and
#: json.dumps recurses once per level (about a thousand levels raise RecursionError).
MAX_METADATA_DEPTH = 100


def json_depth(value: object) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in item)
    return deepest


def sample_from_proto(sample: reward_pb2.Sample) -> RewardSample:
    """The verifiers' view of one wire sample; InvalidArgument when it is malformed."""
    sid = sample.sample_id
    metadata = {}
    if sample.metadata_json:
        try:
            metadata = json.loads(sample.metadata_json)
        except (ValueError, RecursionError) as exc:  # also over-long integers, deep nesting
            raise _reject(
                "bad_metadata", f"sample {sid!r}: metadata_json is not valid JSON: {exc}"
            ) from None
        depth = json_depth(metadata)
        if depth > MAX_METADATA_DEPTH:
            raise _reject(
                "bad_metadata",
                f"sample {sid!r}: metadata_json is nested {depth} levels deep; at most "
                f"{MAX_METADATA_DEPTH} are accepted",
            )
        if not isinstance(metadata, dict):
            raise _reject(
                "bad_metadata",
                f"sample {sid!r}: metadata_json must be a JSON object, got "
                f"{type(metadata).__name__}",
            )
    tokens: list[int] = []
    if sample.HasField("response_token_ids") and sample.response_token_ids.data:
        try:
            array = decode_array(sample.response_token_ids, what=f"sample {sid!r} token ids")
        except TrajectoryError as exc:
            raise _reject("bad_tokens", str(exc)) from None
        if array.dtype.kind not in "iu":
            raise _reject(
                "bad_tokens",
                f"sample {sid!r}: response_token_ids must be an integer tensor (int32), got "
                f"{sample.response_token_ids.dtype}",
            )
        tokens = array.reshape(-1).tolist()
    return RewardSample(
        sample_id=sid,
        prompt=sample.prompt,
        response=sample.response,
        answer=sample.answer,
        metadata=metadata,
        response_token_ids=tokens,
        finish_reason=_finish_reason(sample.finish_reason, sid),
    )


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer

    async def Score(
        self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        samples, combos = [], []
        for wire in request.samples:
            samples.append(sample_from_proto(wire))
            try:
                combos.append(self.scorer.combination(list(wire.verifiers), wire.sample_id))
            except InvalidArgument as exc:
                raise _reject("unknown_verifier", exc.message) from None
        _batch_samples.observe(len(samples))
        results = await self.scorer.score(samples, combos)
        return reward_pb2.ScoreResponse(
            scores=[
                reward_pb2.SampleScore(
                    sample_id=r.sample_id,
                    reward=r.reward,
                    breakdown=r.breakdown,
                    error=r.error,
                    details=r.details,
                )
                for r in results
            ]
        )

    async def ListVerifiers(
        self, request: reward_pb2.ListVerifiersRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ListVerifiersResponse:
        return reward_pb2.ListVerifiersResponse(
            verifiers=[
                reward_pb2.VerifierInfo(name=v.name, description=v.description, weight=v.weight)
                for v in self.scorer.verifiers()
            ]
        )


class RewardService(Service):
    name = "reward"
    service_names = (reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name,)

    def __init__(self, config: JobConfig) -> None:
        self.scorer = Scorer(config)

    def register(self, server: grpc.aio.Server) -> None:
        reward_pb2_grpc.add_RewardServiceServicer_to_server(RewardServicer(self.scorer), server)

    async def start(self) -> None:
        await self.scorer.start()

    async def stop(self) -> None:
        await self.scorer.stop()


def create_service(config: JobConfig) -> RewardService:
    """The entrypoint `kuberl serve reward` calls."""
    return RewardService(config)
