"""The buffer's fast group validation (`kuberl.buffer.validation`) against the reference rules of
`kuberl.common.trajectory`: same verdict and same message on every defect, a valid group accepted
without the reference path, and the groups' bytes taken from the request exactly as sent."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.api.common.v1 import trajectory_pb2 as tpb
from kuberl.buffer import validation
from kuberl.buffer.validation import (
    RawPutRequest,
    _fast_check,
    _reference_check,
    check_group,
    group_payloads,
    group_slices,
)
from kuberl.common.trajectory import TrajectoryError
from tests.integration.buffer_support import GROUP_SIZE, corrupt_put, make_group


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "accepted", fn()
    except TrajectoryError as exc:
        return "refused", str(exc)


def both(msg: tpb.Group, partial: bool = False) -> tuple[tuple[str, Any], tuple[str, Any]]:
    """(check_group's outcome, the reference's outcome) on the same group."""
    return (
        outcome(lambda: check_group(msg, GROUP_SIZE, partial=partial)),
        outcome(lambda: _reference_check(msg, GROUP_SIZE, partial)),
    )


def _set_array(t: tpb.Trajectory, name: str, array: np.ndarray) -> None:
    getattr(t, name).CopyFrom(
        tpb.Tensor(dtype=array.dtype.name, data=np.ascontiguousarray(array).tobytes())
    )


# One defect (or one unusual but valid form) per entry: f(trajectory, value).
MUTATIONS: dict[str, Callable[[tpb.Trajectory, int], None]] = {
    "negative_token": lambda t, v: _set_array(
        t, "response_token_ids", np.array([1, -abs(v) - 1, 3, 4, 5, 6, 7, 8], np.int32)
    ),
    "negative_prompt_token": lambda t, v: _set_array(
        t, "prompt_token_ids", np.array([-abs(v) - 1, 2], np.int32)
    ),
    "empty_prompt": lambda t, v: _set_array(t, "prompt_token_ids", np.zeros(0, np.int32)),
    "mask_value": lambda t, v: _set_array(t, "loss_mask", np.full(8, 2 + abs(v) % 250, np.uint8)),
    "nan_logprob": lambda t, v: _set_array(
        t, "rollout_logprobs", np.where(np.arange(8) == abs(v) % 8, np.nan, -1.0).astype("f4")
    ),
    "inf_logprob": lambda t, v: _set_array(
        t, "rollout_logprobs", np.where(np.arange(8) == abs(v) % 8, np.inf, -1.0).astype("f4")
    ),
    "float64_logprobs": lambda t, v: _set_array(t, "rollout_logprobs", -np.ones(8)),
    "int64_ids": lambda t, v: _set_array(t, "response_token_ids", np.arange(8, dtype=np.int64)),
    "float_ids": lambda t, v: _set_array(t, "response_token_ids", np.arange(8, dtype="f4")),
    "bool_mask": lambda t, v: _set_array(t, "loss_mask", np.ones(8, bool)),
    "float_mask": lambda t, v: _set_array(t, "loss_mask", np.ones(8, "f4")),
    "dtype_name": lambda t, v: setattr(
        t.response_token_ids, "dtype", ["", "int128", "bfloat16", "int16", "uint8"][abs(v) % 5]
    ),
    "shape_1d": lambda t, v: t.response_token_ids.shape.extend(
        [len(t.response_token_ids.data) // 4]
    ),
    "shape_2d": lambda t, v: t.response_token_ids.shape.extend([2, 4]),
    "shape_negative": lambda t, v: t.loss_mask.shape.extend([-8]),
    "truncate_bytes": lambda t, v: setattr(
        t.rollout_logprobs, "data", t.rollout_logprobs.data[: -(abs(v) % 5 + 1)]
    ),
    "extra_mask_byte": lambda t, v: setattr(t.loss_mask, "data", t.loss_mask.data + b"\x01"),
    "nan_reward": lambda t, v: setattr(t, "reward", math.nan),
    "inf_reward": lambda t, v: setattr(t, "reward", -math.inf),
    "reward": lambda t, v: setattr(t, "reward", v / 3),
    "nan_breakdown": lambda t, v: t.reward_breakdown.update({"format": math.nan}),
    "breakdown": lambda t, v: t.reward_breakdown.update({"format": float(v)}),
    "inf_timing": lambda t, v: setattr(t.timings, "generate_seconds", math.inf),
    "nan_finished": lambda t, v: setattr(t.timings, "finished_unix", math.nan),
    "version_start": lambda t, v: setattr(t, "policy_version_start", v),
    "version_end": lambda t, v: setattr(t, "policy_version_end", v),
    "sample_index": lambda t, v: setattr(t, "sample_index", v),
    "prompt_id": lambda t, v: setattr(t, "prompt_id", f"train:{abs(v) % 2}"),
    "epoch": lambda t, v: setattr(t, "epoch", v),
    "finish_reason": lambda t, v: setattr(t, "finish_reason", abs(v) % 7),  # type: ignore[arg-type]
    "metadata": lambda t, v: setattr(
        t, "metadata_json", ["", "{}", '{"turns": 2}', "[1]", "{", "7", "null"][abs(v) % 7]
    ),
}


@pytest.mark.parametrize(
    "defect",
    [
        "group_size",
        "logprobs_length",
        "mask_length",
        "nan_reward",
        "inf_logprob",
        "nan_breakdown",
        "bad_dtype",
        "ragged_bytes",
        "other_prompt",
        "repeated_sample_index",
    ],
)
def test_each_defect_of_the_service_tests_gets_the_reference_message(defect: str) -> None:
    (group,), _ = corrupt_put(defect)
    fast, reference = both(group)
    assert fast == reference and fast[0] == "refused"


@pytest.mark.parametrize("value", [0, 1, 5])
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_mutation_alone_gets_the_reference_verdict_and_message(name: str, value: int) -> None:
    group = make_group("train:0")
    MUTATIONS[name](group.trajectories[1], value)
    fast, reference = both(group)
    assert fast == reference


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mutations=st.lists(
        st.tuples(
            st.sampled_from(sorted(MUTATIONS)),
            st.integers(0, GROUP_SIZE - 1),
            st.integers(-3, 2**31 - 2),
        ),
        max_size=3,
    ),
    size=st.integers(0, GROUP_SIZE + 1),
    partial=st.booleans(),
    group_id=st.sampled_from(["", "g-1"]),
    prompt_id=st.sampled_from(["train:0", ""]),
)
def test_random_defects_get_the_reference_verdict_and_message(
    mutations: list[tuple[str, int, int]], size: int, partial: bool, group_id: str, prompt_id: str
) -> None:
    group = make_group("train:0", size=size)
    group.group_id, group.prompt_id = group_id, prompt_id
    for name, which, value in mutations:
        if which < size:
            MUTATIONS[name](group.trajectories[which], value)
    fast, reference = both(group, partial)
    assert fast == reference
    quick = _fast_check(group, GROUP_SIZE, partial)
    assert quick is None or ("accepted", quick) == reference


def test_a_valid_group_is_accepted_without_the_reference_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def slow(*args: object) -> None:
        raise AssertionError("the reference path ran")

    monkeypatch.setattr(validation, "_reference_check", slow)
    group = make_group("train:0", rewards=[1.0] * GROUP_SIZE, version=3)
    group.trajectories[2].policy_version_start = 2
    checked = check_group(group, GROUP_SIZE)
    assert (checked.group_id, checked.version, checked.zero_variance) == ("train:0@0", 2, True)


def _request(groups: list[tpb.Group]) -> bytes:
    return bpb.PutTrajectoriesRequest(
        consumer="r0", groups=groups, lease_ids=["1-0"] * len(groups), kind=tpb.STREAM_KIND_TRAIN
    ).SerializeToString()


def test_the_stored_bytes_of_each_group_are_its_bytes_in_the_request() -> None:
    groups = [make_group(f"train:{i}") for i in range(3)]
    for g in groups:
        g.group_id = f"{g.prompt_id}@x"
    raw = RawPutRequest.parse(_request(groups))
    checked = [check_group(g, GROUP_SIZE) for g in raw.message.groups]
    payloads = group_payloads(raw.message.groups, checked, raw.data)
    assert [bytes(p) for p in payloads] == [g.SerializeToString() for g in groups]


def test_a_group_sent_without_an_id_is_stored_with_prompt_at_epoch() -> None:
    group = make_group("train:3", epoch=2)
    group.group_id = ""
    raw = RawPutRequest.parse(_request([group]))
    checked = [check_group(g, GROUP_SIZE) for g in raw.message.groups]
    (payload,) = group_payloads(raw.message.groups, checked, raw.data)
    stored = tpb.Group.FromString(bytes(payload))
    group.group_id = "train:3@2"
    assert stored == group


def test_fields_in_any_order_and_unknown_fields_still_find_every_group() -> None:
    groups = [make_group("train:0"), make_group("train:1")]
    unknown = b"\xa8\x1f\x07"  # field 501, varint 7: not in the message
    parts = [
        bpb.PutTrajectoriesRequest(lease_ids=["1-0"]).SerializeToString(),
        bpb.PutTrajectoriesRequest(groups=groups[:1]).SerializeToString(),
        unknown,
        bpb.PutTrajectoriesRequest(consumer="r0").SerializeToString(),
        bpb.PutTrajectoriesRequest(groups=groups[1:]).SerializeToString(),
    ]
    data = b"".join(parts)
    slices = group_slices(data, len(bpb.PutTrajectoriesRequest.FromString(data).groups))
    assert slices is not None
    assert [bytes(s) for s in slices] == [g.SerializeToString() for g in groups]


@pytest.mark.parametrize("cut", [1, 3, 100])
def test_a_request_the_reader_cannot_follow_is_encoded_anew(cut: int) -> None:
    data = _request([make_group("train:0")])
    assert group_slices(data[:-cut], 1) is None
    assert group_slices(data, 2) is None
