"""The trajectory data model: proto round-trips and validation of what arrives on the wire."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kuberl.api.common.v1 import trajectory_pb2 as pb
from kuberl.common.trajectory import (
    Group,
    Trajectory,
    TrajectoryError,
    decode_array,
    encode_array,
)


def _trajectory(length: int, **kw) -> Trajectory:
    rng = np.random.default_rng(length)
    return Trajectory(
        prompt_token_ids=rng.integers(0, 150_000, 7),
        response_token_ids=rng.integers(0, 150_000, length),
        rollout_logprobs=-rng.random(length).astype(np.float32),
        loss_mask=rng.integers(0, 2, length),
        prompt_id="p1",
        group_id="p1@0",
        epoch=0,
        sample_index=3,
        reward=0.5,
        reward_breakdown={"gsm8k": 1.0, "length": -0.5},
        finish_reason="length",
        policy_version_start=4,
        policy_version_end=5,
        generate_seconds=1.25,
        metadata={"turns": 2},
        response_text="x" * min(length, 10),
        **kw,
    )


def _same(a: Trajectory, b: Trajectory) -> bool:
    arrays = ("prompt_token_ids", "response_token_ids", "rollout_logprobs", "loss_mask")
    scalars = {k: v for k, v in vars(a).items() if k not in arrays}
    return all(np.array_equal(getattr(a, k), getattr(b, k)) for k in arrays) and scalars == {
        k: v for k, v in vars(b).items() if k not in arrays
    }


@pytest.mark.parametrize("length", [0, 1, 32_768])
def test_round_trip_through_proto_bytes_is_exact(length: int) -> None:
    original = _trajectory(length)
    wire = original.to_proto().SerializeToString()
    assert _same(Trajectory.from_proto(pb.Trajectory.FromString(wire)), original)


def test_a_32k_response_travels_as_bytes_not_repeated_scalars() -> None:
    msg = _trajectory(32_768).to_proto()
    # 4 bytes per token id + 4 per logprob + 1 per mask entry, plus small overhead.
    assert msg.ByteSize() < 32_768 * 9 + 1024


def test_group_round_trip_keeps_every_sample() -> None:
    group = Group(
        "p1",
        0,
        [
            _trajectory(
                5,
            )
            for _ in range(4)
        ],
    )
    back = Group.from_proto(pb.Group.FromString(group.to_proto().SerializeToString()))
    assert (back.group_id, len(back.trajectories)) == ("p1@0", 4)


def test_decoded_arrays_are_little_endian_whatever_the_input() -> None:
    big = np.arange(5, dtype=">i4")
    assert decode_array(encode_array(big)).tolist() == [0, 1, 2, 3, 4]


def test_a_multidimensional_tensor_keeps_its_shape() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert np.array_equal(decode_array(encode_array(x)), x)


def test_a_byte_length_that_does_not_match_the_dtype_is_rejected() -> None:
    with pytest.raises(TrajectoryError, match="7 bytes is not a whole number of int32"):
        decode_array(pb.Tensor(dtype="int32", data=b"\0" * 7))


def test_a_shape_that_does_not_match_the_bytes_is_rejected() -> None:
    with pytest.raises(TrajectoryError, match=r"shape \[2, 2\] of float32 needs 16 bytes, got 8"):
        decode_array(pb.Tensor(dtype="float32", shape=[2, 2], data=b"\0" * 8))


def test_an_unknown_dtype_is_rejected_with_the_allowed_list() -> None:
    with pytest.raises(TrajectoryError, match="unsupported dtype 'complex64'; expected one of"):
        decode_array(pb.Tensor(dtype="complex64", data=b"\0" * 8))


def test_mismatched_lengths_fail_validation() -> None:
    t = _trajectory(4)
    t.rollout_logprobs = t.rollout_logprobs[:3]
    with pytest.raises(
        TrajectoryError, match="rollout_logprobs has 3 entries but response_token_ids has 4"
    ):
        t.validate()


@pytest.mark.parametrize("field", ["reward", "logprob", "breakdown"])
def test_non_finite_numbers_fail_validation(field: str) -> None:
    t = _trajectory(4)
    if field == "reward":
        t.reward = math.nan
    elif field == "logprob":
        t.rollout_logprobs[2] = -math.inf
    else:
        t.reward_breakdown["gsm8k"] = math.inf
    with pytest.raises(TrajectoryError):
        t.validate()


def test_a_group_of_the_wrong_size_fails_validation() -> None:
    with pytest.raises(TrajectoryError, match="has 2 trajectories, the job's group size is 8"):
        Group("p1", 0, [_trajectory(3), _trajectory(3)]).validate(group_size=8)


def test_a_sample_from_another_prompt_fails_group_validation() -> None:
    stray = _trajectory(3)
    stray.prompt_id = "p2"
    with pytest.raises(TrajectoryError, match="belongs to prompt 'p2'"):
        Group("p1", 0, [_trajectory(3), stray]).validate()


def test_metadata_that_is_not_json_is_rejected() -> None:
    msg = _trajectory(2).to_proto()
    msg.metadata_json = "{not json"
    with pytest.raises(TrajectoryError, match="metadata_json is not JSON"):
        Trajectory.from_proto(msg)


def test_an_unspecified_finish_reason_is_rejected() -> None:
    msg = _trajectory(2).to_proto()
    msg.finish_reason = pb.FINISH_REASON_UNSPECIFIED
    with pytest.raises(TrajectoryError, match="finish_reason is unspecified"):
        Trajectory.from_proto(msg)
