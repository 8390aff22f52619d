"""The trajectory data model every service passes around, and its conversion to and from protos.

Rollout builds `Trajectory` objects, the buffer validates and stores their protos, the trainer
reads them back as numpy arrays. Numeric arrays travel as little-endian bytes with their dtype
(`kuberl.common.v1.Tensor`), decoded without copies by `numpy.frombuffer`.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kuberl.api.common.v1 import trajectory_pb2 as pb
from kuberl.common.dtypes import ITEMSIZES

# Dtypes allowed on the wire. bfloat16 has no numpy dtype: it is carried as raw 2-byte words and
# decoded by torch (`torch.frombuffer(..., dtype=torch.bfloat16)`).
_ITEMSIZE = {k: v for k, v in ITEMSIZES.items() if not k.startswith("float8")}

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "turn_limit": pb.FINISH_REASON_TURN_LIMIT,
}
_FINISH_NAMES = {v: k for k, v in FINISH_REASONS.items()}
# numpy dtype kinds each array of a trajectory may arrive in (i/u: integers, f: floats, b: bool).
_ARRAY_KINDS = {
    "prompt_token_ids": "iu",
    "response_token_ids": "iu",
    "rollout_logprobs": "f",
    "loss_mask": "ub",
}
_KIND_NAMES = {"iu": "integer", "f": "floating-point", "ub": "uint8 or bool"}


class TrajectoryError(ValueError):
    """A trajectory or tensor that cannot be decoded or is inconsistent; the message says why."""


def itemsize(dtype: str) -> int:
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise TrajectoryError(
            f"unsupported dtype {dtype!r}; expected one of {', '.join(_ITEMSIZE)}"
        ) from None


def encode_array(array: np.ndarray) -> pb.Tensor:
    """A numpy array as a Tensor proto (little-endian, C order)."""
    arr = np.asarray(array)
    name = arr.dtype.name
    itemsize(name)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    shape = list(arr.shape) if arr.ndim != 1 else []
    return pb.Tensor(dtype=name, shape=shape, data=np.ascontiguousarray(arr).tobytes())


def decode_array(tensor: pb.Tensor, *, what: str = "tensor") -> np.ndarray:
    """A Tensor proto as a read-only numpy array; TrajectoryError if dtype or length is wrong."""
    size = itemsize(tensor.dtype) if tensor.dtype else 0
    if not tensor.dtype:
        if tensor.data:
            raise TrajectoryError(f"{what}: dtype is empty but data has {len(tensor.data)} bytes")
        return np.zeros(0, dtype=np.float32)
    if tensor.dtype == "bfloat16":
        raise TrajectoryError(f"{what}: bfloat16 has no numpy dtype; decode it with torch")
    n = len(tensor.data)
    if tensor.shape:
        if any(d < 0 for d in tensor.shape):
            raise TrajectoryError(f"{what}: negative dimension in shape {list(tensor.shape)}")
        expected = math.prod(tensor.shape) * size
        if expected != n:
            raise TrajectoryError(
                f"{what}: shape {list(tensor.shape)} of {tensor.dtype} needs {expected} bytes, "
                f"got {n}"
            )
    elif n % size:
        raise TrajectoryError(
            f"{what}: {n} bytes is not a whole number of {tensor.dtype} ({size}-byte) elements"
        )
    arr = np.frombuffer(tensor.data, dtype=np.dtype(tensor.dtype).newbyteorder("<"))
    return arr.reshape(tuple(tensor.shape)) if tensor.shape else arr


@dataclass
class Trajectory:
    """One sampled response to one prompt, with everything training needs (see the proto)."""

    prompt_token_ids: np.ndarray  # int32 [P]
    response_token_ids: np.ndarray  # int32 [R]
    rollout_logprobs: np.ndarray  # float32 [R]
    loss_mask: np.ndarray | None = None  # uint8 [R]; None means all ones
    prompt_id: str = ""
    group_id: str = ""
    epoch: int = 0
    sample_index: int = 0
    reward: float = 0.0
    reward_breakdown: dict[str, float] = field(default_factory=dict)
    finish_reason: str = "stop"
    policy_version_start: int = 0
    policy_version_end: int = 0
    queued_seconds: float = 0.0
    generate_seconds: float = 0.0
    score_seconds: float = 0.0
    finished_unix: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    response_text: str = ""
    trajectory_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        self.prompt_token_ids = np.asarray(self.prompt_token_ids, dtype=np.int32)
        self.response_token_ids = np.asarray(self.response_token_ids, dtype=np.int32)
        self.rollout_logprobs = np.asarray(self.rollout_logprobs, dtype=np.float32)
        if self.loss_mask is None:
            self.loss_mask = np.ones(len(self.response_token_ids), dtype=np.uint8)
        else:
            self.loss_mask = np.asarray(self.loss_mask, dtype=np.uint8)
        if self.finish_reason not in FINISH_REASONS:
            raise TrajectoryError(
                f"finish_reason {self.finish_reason!r}; expected one of {', '.join(FINISH_REASONS)}"
            )

    def validate(self) -> None:
        """Raise TrajectoryError unless arrays agree in length, numbers are finite and every
        value is one a trajectory can have (token ids >= 0, a 0/1 mask, a non-empty prompt,
        versions >= 0 with start <= end, sample_index >= 0)."""
        r = len(self.response_token_ids)
        assert self.loss_mask is not None
        tid = self.trajectory_id
        if len(self.prompt_token_ids) == 0:
            raise TrajectoryError(f"trajectory {tid}: prompt_token_ids is empty")
        for name in ("prompt_token_ids", "response_token_ids"):
            ids = getattr(self, name)
            if ids.size and int(ids.min()) < 0:
                raise TrajectoryError(f"trajectory {tid}: {name} has a negative id {ids.min()}")
        if self.loss_mask.size and int(self.loss_mask.max()) > 1:
            raise TrajectoryError(f"trajectory {tid}: loss_mask values must be 0 or 1")
        for name in ("queued_seconds", "generate_seconds", "score_seconds", "finished_unix"):
            if not math.isfinite(getattr(self, name)):
                raise TrajectoryError(f"trajectory {tid}: timings.{name} is {getattr(self, name)}")
        start, end = self.policy_version_start, self.policy_version_end
        if start < 0 or end < 0 or start > end:
            raise TrajectoryError(
                f"trajectory {tid}: policy versions must be >= 0 with start <= end, got "
                f"start {start} end {end}"
            )
        if self.sample_index < 0:
            raise TrajectoryError(f"trajectory {tid}: sample_index {self.sample_index} < 0")
        for name, arr in (
            ("rollout_logprobs", self.rollout_logprobs),
            ("loss_mask", self.loss_mask),
        ):
            if len(arr) != r:
                raise TrajectoryError(
                    f"trajectory {self.trajectory_id}: {name} has {len(arr)} entries but "
                    f"response_token_ids has {r}"
                )
        if not math.isfinite(self.reward):
            raise TrajectoryError(f"trajectory {self.trajectory_id}: reward is {self.reward}")
        if not np.isfinite(self.rollout_logprobs).all():
            bad = int(np.argmin(np.isfinite(self.rollout_logprobs)))
            raise TrajectoryError(
                f"trajectory {self.trajectory_id}: rollout_logprobs[{bad}] is "
                f"{self.rollout_logprobs[bad]}"
            )
        for key, value in self.reward_breakdown.items():
            if not math.isfinite(value):
                raise TrajectoryError(
                    f"trajectory {self.trajectory_id}: reward_breakdown[{key!r}] is {value}"
                )

    def to_proto(self) -> pb.Trajectory:
        return pb.Trajectory(
            trajectory_id=self.trajectory_id,
            group_id=self.group_id,
            prompt_id=self.prompt_id,
            epoch=self.epoch,
            sample_index=self.sample_index,
            prompt_token_ids=encode_array(self.prompt_token_ids),
            response_token_ids=encode_array(self.response_token_ids),
            rollout_logprobs=encode_array(self.rollout_logprobs),
            loss_mask=encode_array(self.loss_mask),  # type: ignore[arg-type]
            reward=self.reward,
            reward_breakdown=self.reward_breakdown,
            finish_reason=FINISH_REASONS[self.finish_reason],
            policy_version_start=self.policy_version_start,
            policy_version_end=self.policy_version_end,
            timings=pb.Timings(
                queued_seconds=self.queued_seconds,
                generate_seconds=self.generate_seconds,
                score_seconds=self.score_seconds,
                finished_unix=self.finished_unix,
            ),
            metadata_json=json.dumps(self.metadata) if self.metadata else "",
            response_text=self.response_text,
        )

    @classmethod
    def from_proto(cls, msg: pb.Trajectory) -> Trajectory:
        """Decode a proto; TrajectoryError names the field when anything is malformed."""
        tid = msg.trajectory_id or "<no id>"
        try:
            metadata = json.loads(msg.metadata_json) if msg.metadata_json else {}
        except json.JSONDecodeError as exc:
            raise TrajectoryError(f"trajectory {tid}: metadata_json is not JSON: {exc}") from None
        if not isinstance(metadata, dict):
            raise TrajectoryError(f"trajectory {tid}: metadata_json must be a JSON object")
        finish = _FINISH_NAMES.get(msg.finish_reason)
        if finish is None:
            raise TrajectoryError(f"trajectory {tid}: finish_reason is unspecified")
        arrays = {
            name: decode_array(getattr(msg, name), what=f"trajectory {tid}: {name}")
            for name in ("prompt_token_ids", "response_token_ids", "rollout_logprobs", "loss_mask")
        }
        for name, array in arrays.items():
            # The constructor converts with astype: refuse what would convert silently (float
            # token ids truncated, a float mask, 2-D arrays measured by their first axis).
            kinds = _ARRAY_KINDS[name]
            if (array.size and array.dtype.kind not in kinds) or array.ndim > 1:
                raise TrajectoryError(
                    f"trajectory {tid}: {name} must be a 1-D {_KIND_NAMES[kinds]} tensor, got "
                    f"{getattr(msg, name).dtype} with shape {list(array.shape)}"
                )
        return cls(
            **arrays,
            trajectory_id=msg.trajectory_id,
            group_id=msg.group_id,
            prompt_id=msg.prompt_id,
            epoch=msg.epoch,
            sample_index=msg.sample_index,
            reward=msg.reward,
            reward_breakdown=dict(msg.reward_breakdown),
            finish_reason=finish,
            policy_version_start=msg.policy_version_start,
            policy_version_end=msg.policy_version_end,
            queued_seconds=msg.timings.queued_seconds,
            generate_seconds=msg.timings.generate_seconds,
            score_seconds=msg.timings.score_seconds,
            finished_unix=msg.timings.finished_unix,
            metadata=metadata,
            response_text=msg.response_text,
        )


@dataclass
class Group:
    """All n samples of one prompt in one epoch: the unit the buffer accepts and hands out."""

    prompt_id: str
    epoch: int
    trajectories: list[Trajectory]
    group_id: str = ""

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = f"{self.prompt_id}@{self.epoch}"

    def validate(self, group_size: int | None = None) -> None:
        if group_size is not None and len(self.trajectories) != group_size:
            raise TrajectoryError(
                f"group {self.group_id}: has {len(self.trajectories)} trajectories, "
                f"the job's group size is {group_size}"
            )
        for i, t in enumerate(self.trajectories):
            if group_size is not None and t.sample_index >= group_size:
                raise TrajectoryError(
                    f"group {self.group_id}: trajectory {i} has sample_index {t.sample_index}, "
                    f"outside 0..{group_size - 1}"
                )
            if (t.prompt_id, t.epoch) != (self.prompt_id, self.epoch):
                raise TrajectoryError(
                    f"group {self.group_id}: trajectory {i} belongs to prompt {t.prompt_id!r} "
                    f"epoch {t.epoch}, not prompt {self.prompt_id!r} epoch {self.epoch}"
                )
            t.validate()

    def to_proto(self) -> pb.Group:
        return pb.Group(
            group_id=self.group_id,
            prompt_id=self.prompt_id,
            epoch=self.epoch,
            trajectories=[t.to_proto() for t in self.trajectories],
        )

    @classmethod
    def from_proto(cls, msg: pb.Group) -> Group:
        return cls(
            prompt_id=msg.prompt_id,
            epoch=msg.epoch,
            trajectories=[Trajectory.from_proto(t) for t in msg.trajectories],
            group_id=msg.group_id,
        )
