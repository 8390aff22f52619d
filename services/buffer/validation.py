"""Validation of the groups rollout puts, fast enough for the buffer's hot path.

`PutTrajectories` must refuse a group whose arrays disagree in length, whose numbers are not
finite or whose values no trajectory can have, and say why. The rules and messages are those of
`kuberl.common.trajectory` (`Group.from_proto` + `validate`), but building a `Trajectory` per
sample and checking it one array at a time costs about 0.75 ms per group of 8 x 2,048 tokens,
which was most of the buffer's CPU. `check_group` instead reads the proto's fields directly and
checks the arrays of a whole group at once: one numpy reduction each over all token ids, all loss
masks and all logprobs of the group (joined bytes read with `numpy.frombuffer`), plus a few
comparisons per trajectory.

The fast path only ever *accepts*. Anything it does not recognise as plainly valid (a dtype other
than int32/float32/uint8, an explicit shape, metadata that does not parse, any failed check) goes
to the reference path, which raises the exact TrajectoryError, or accepts what the fast path was
too strict for. So accepting and refusing, and every message, are the reference's by
construction; tests/unit/test_buffer_validation.py compares the two on random defects.

`group_payloads` finds the serialized bytes of each group inside the request as it came off the
wire, so the buffer stores them as they are instead of encoding every group again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.api.common.v1 import trajectory_pb2 as tpb
from kuberl.common.config import JobConfig
from kuberl.common.modelbuild import MAX_POSITIONS
from kuberl.common.trajectory import FINISH_REASONS, Group, TrajectoryError
from kuberl.common.wire import encode_entries, read_varint

# Rewards closer than this count as equal for the dynamic-sampling (zero variance) filter.
REWARD_TOLERANCE = 1e-9
# A log-probability above this is not one (float32 rounding of log-softmax stays below it).
LOGPROB_TOLERANCE = 1e-4
_ABORT = tpb.FINISH_REASON_ABORT

_FINISH_VALUES = frozenset(FINISH_REASONS.values())
_isfinite = math.isfinite


@dataclass(frozen=True, slots=True)
class CheckedGroup:
    """What the buffer stores about a valid group besides its bytes."""

    group_id: str  # the request's, or `<prompt>@<epoch>` when it had none
    prompt_id: str
    epoch: int
    size: int
    version: int  # oldest policy_version_start of its samples (0 for an empty group)
    zero_variance: bool  # all rewards agree (within REWARD_TOLERANCE)
    # What the job's limits (JobLimits.refusal) are checked against:
    newest: int = 0  # newest policy_version_end of its samples
    longest: int = 0  # most prompt + response tokens of one sample
    max_logprob: float = -math.inf  # highest rollout logprob of any token
    empty: int = 0  # samples with no response tokens that were not aborted


@dataclass(frozen=True)
class JobLimits:
    """Bounds of a valid group that depend on the job, not on the group alone."""

    kinds: frozenset[str]  # the stream kinds the job reads (others would never be trained)
    max_tokens: int  # prompt + response tokens of one sample: the model's positions (0: none)
    max_version: int = 2**53 - 1  # Lua scripts compute in doubles

    def refusal(self, kind: str, c: CheckedGroup) -> tuple[str, str] | None:
        """(reason, message) when a valid group of `kind` is still not one this job can train."""
        if kind not in self.kinds:
            return "kind_not_read", (
                f"this job does not read {kind.upper()} groups (it reads "
                f"{', '.join(sorted(k.upper() for k in self.kinds))}): nothing would train them"
            )
        if c.newest > self.max_version:
            return "version_out_of_range", (
                f"policy version {c.newest} is above {self.max_version}, the largest the buffer "
                "stores exactly"
            )
        if self.max_tokens and c.longest > self.max_tokens:
            return "too_long", (
                f"a sample has {c.longest} prompt + response tokens, more than the model's "
                f"{self.max_tokens} positions"
            )
        if c.max_logprob > LOGPROB_TOLERANCE:
            return "positive_logprob", (
                f"rollout_logprobs has {c.max_logprob:g}: log-probabilities are <= 0"
            )
        if c.empty:
            return "empty_response", (
                f"{c.empty} sample(s) have no response tokens; only an aborted generation "
                "(finish_reason ABORT) may be empty"
            )
        return None


def job_limits(config: JobConfig) -> JobLimits:
    """The limits of `config`'s job: the kinds its trainer reads (SFT also when its rollout
    runs rejection sampling, whose output it is) and the model's positions."""
    tc = config.trainer
    kinds = {"eval"}
    if tc.mode == "rl":
        kinds.add("train")
    reads_sft = tc.sft_data is None and (tc.mode == "sft" or (tc.mode == "rl" and tc.sft_steps))
    if reads_sft or config.rollout.mode == "rejection_sampling":  # its output is the SFT stream
        kinds.add("sft")
    return JobLimits(
        frozenset(kinds), config.buffer.max_sequence_tokens or model_positions(config.model.path)
    )


def model_positions(path: str | None) -> int:
    """The model's max_position_embeddings (a model kuberl builds when path is None); 0 when
    its config.json cannot be read here."""
    if path is None:
        return MAX_POSITIONS
    try:
        value = json.loads((Path(path) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return 0
    return value if isinstance(value, int) and value > 0 else 0


def check_group(msg: tpb.Group, group_size: int, *, partial: bool = False) -> CheckedGroup:
    """Validate one group of a put; TrajectoryError says what is wrong.

    `partial` (SFT groups from rejection sampling) allows 0..group_size samples instead of
    exactly group_size."""
    checked = _fast_check(msg, group_size, partial)
    if checked is None:
        checked = _reference_check(msg, group_size, partial)
    return checked


def _fast_check(msg: tpb.Group, group_size: int, partial: bool) -> CheckedGroup | None:
    """The group's summary if it is plainly valid; None when the reference must decide."""
    pid, epoch = msg.prompt_id, msg.epoch
    trajectories = msg.trajectories
    n = len(trajectories)
    if not pid or n > group_size or (n < group_size and not partial):
        return None
    ids: list[bytes] = []
    logprobs: list[bytes] = []
    masks: list[bytes] = []
    seen: set[int] = set()
    rewards: list[float] = []
    version, newest, longest, empty = -1, 0, 0, 0
    for t in trajectories:
        if t.prompt_id != pid or t.epoch != epoch or t.finish_reason not in _FINISH_VALUES:
            return None
        index = t.sample_index
        if index < 0 or index >= group_size or index in seen:
            return None
        seen.add(index)
        start, end = t.policy_version_start, t.policy_version_end
        if start < 0 or start > end:
            return None
        reward = t.reward
        if not _isfinite(reward):
            return None
        if t.reward_breakdown and not all(map(_isfinite, t.reward_breakdown.values())):
            return None
        tm = t.timings
        if not (
            _isfinite(tm.queued_seconds)
            and _isfinite(tm.generate_seconds)
            and _isfinite(tm.score_seconds)
            and _isfinite(tm.finished_unix)
        ):
            return None
        if t.metadata_json and not _is_json_object(t.metadata_json):
            return None
        p, r, lp, mk = t.prompt_token_ids, t.response_token_ids, t.rollout_logprobs, t.loss_mask
        if (
            p.dtype != "int32"
            or r.dtype != "int32"
            or lp.dtype != "float32"
            or mk.dtype != "uint8"
            or p.shape
            or r.shape
            or lp.shape
            or mk.shape
        ):
            return None
        pd, rd, ld, md = p.data, r.data, lp.data, mk.data
        length = len(md)  # uint8: one byte per response token
        if not pd or len(pd) % 4 or len(rd) != 4 * length or len(ld) != 4 * length:
            return None
        ids += (pd, rd)
        logprobs.append(ld)
        masks.append(md)
        rewards.append(reward)
        version = start if version < 0 else min(version, start)
        newest = max(newest, end)
        longest = max(longest, len(pd) // 4 + length)
        empty += not length and t.finish_reason != _ABORT
    # One reduction per array kind for the whole group (the bytes are little-endian).
    if ids and int(np.frombuffer(b"".join(ids), dtype="<i4").min()) < 0:
        return None
    mask = b"".join(masks)
    if mask and int(np.frombuffer(mask, dtype=np.uint8).max()) > 1:
        return None
    lp_all = b"".join(logprobs)
    max_logprob = -math.inf
    if lp_all:
        values = np.frombuffer(lp_all, dtype="<f4")
        if not np.isfinite(values).all():
            return None
        max_logprob = float(values.max())
    return CheckedGroup(
        group_id=msg.group_id or f"{pid}@{epoch}",
        prompt_id=pid,
        epoch=epoch,
        size=n,
        version=max(version, 0),
        zero_variance=n > 0 and max(rewards) - min(rewards) <= REWARD_TOLERANCE,
        newest=newest,
        longest=longest,
        max_logprob=max_logprob,
        empty=empty,
    )


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except Exception:  # the reference path reports it (or raises what it raises)
        return False


def _reference_check(msg: tpb.Group, group_size: int, partial: bool) -> CheckedGroup:
    """The rules of `kuberl.common.trajectory`, object by object; raises with their messages."""
    group = Group.from_proto(msg)
    n = len(group.trajectories)
    if not group.prompt_id:
        raise TrajectoryError("prompt_id is empty")
    if partial:
        if n > group_size:
            raise TrajectoryError(
                f"group {group.group_id}: has {n} trajectories, more than the job's group "
                f"size {group_size}"
            )
        group.validate()
    else:
        group.validate(group_size)
    indices = [t.sample_index for t in group.trajectories]
    if len(set(indices)) != n:
        raise TrajectoryError(f"group {group.group_id}: sample_index values repeat: {indices}")
    ts = group.trajectories
    rewards = [t.reward for t in ts]
    return CheckedGroup(
        group_id=group.group_id,
        prompt_id=group.prompt_id,
        epoch=group.epoch,
        size=n,
        version=min((t.policy_version_start for t in ts), default=0),
        zero_variance=n > 0 and max(rewards) - min(rewards) <= REWARD_TOLERANCE,
        newest=max((t.policy_version_end for t in ts), default=0),
        longest=max((len(t.prompt_token_ids) + len(t.response_token_ids) for t in ts), default=0),
        max_logprob=max(
            (float(t.rollout_logprobs.max()) for t in ts if len(t.rollout_logprobs)),
            default=-math.inf,
        ),
        empty=sum(1 for t in ts if not len(t.response_token_ids) and t.finish_reason != "abort"),
    )


# -- the groups' bytes as they came ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RawPutRequest:
    """A PutTrajectoriesRequest together with the bytes it was parsed from (the gRPC
    deserializer of PutTrajectories returns this, so the groups' bytes can be stored as sent)."""

    message: bpb.PutTrajectoriesRequest
    data: bytes

    @classmethod
    def parse(cls, data: bytes) -> RawPutRequest:
        return cls(bpb.PutTrajectoriesRequest.FromString(data), data)


_GROUPS_FIELD = bpb.PutTrajectoriesRequest.GROUPS_FIELD_NUMBER


def group_slices(data: bytes, count: int) -> list[memoryview] | None:
    """The bytes of each `groups` entry of a serialized PutTrajectoriesRequest, in order, without
    copying; None if the encoding is not the plain one this reader follows (the caller then
    encodes the parsed groups instead). `count` is how many groups the parsed message has."""
    view = memoryview(data)
    out: list[memoryview] = []
    i, end = 0, len(data)
    try:
        while i < end:
            key, i = read_varint(data, i)
            wire = key & 7
            if wire == 2:
                size, i = read_varint(data, i)
                if key >> 3 == _GROUPS_FIELD:
                    out.append(view[i : i + size])
                i += size
            elif wire == 0:
                _, i = read_varint(data, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            else:  # start/end group: proto3 encoders never write them
                return None
    except IndexError:
        return None
    if i != end or len(out) != count:
        return None
    return out


def group_payloads(
    groups: Sequence[tpb.Group], checked: Sequence[CheckedGroup], raw: bytes | None
) -> list[bytes | memoryview]:
    """The bytes to store for each group: as sent (from `raw`, the request's bytes, when given
    and readable) with the group id appended where the request had none, else encoded anew.
    Empty (SFT) groups store nothing (b"")."""
    slices = group_slices(raw, len(groups)) if raw is not None else None
    out: list[bytes | memoryview] = []
    for i, (msg, c) in enumerate(zip(groups, checked, strict=True)):
        if not c.size:
            out.append(b"")
            continue
        missing_id = not msg.group_id
        if missing_id:
            msg.group_id = c.group_id
        if slices is None:
            out.append(msg.SerializeToString())
        elif missing_id:
            # A later occurrence of a scalar field wins when parsing, so appending sets it.
            gid = c.group_id.encode()
            out.append(encode_entries(slices[i], tpb.Group.GROUP_ID_FIELD_NUMBER, [gid]))
        else:
            out.append(slices[i])
    return out
