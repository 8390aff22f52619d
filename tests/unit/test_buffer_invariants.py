"""The buffer's invariants against well-formed but hostile or buggy requests (docs/security.md).

Each test sends one request a correct rollout or trainer never sends and checks that the job's
state stays what it was, that the refusal is INVALID_ARGUMENT (never UNAVAILABLE) with its reason
counted in `kuberl_buffer_rejections_total`, or that GetBatch leaves the group out. A real
BufferService on a real (embedded) Redis, as in test_buffer_logic.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.api.common.v1 import trajectory_pb2 as tpb
from kuberl.buffer import metrics as m
from kuberl.buffer.server import MAX_RELEASE_IDS
from kuberl.common.errors import FailedPrecondition, InvalidArgument
from kuberl.common.trajectory import encode_array
from tests.integration.buffer_support import make_group
from tests.support import ServiceProcess
from tests.unit.test_buffer_logic import (
    SFT,
    TRAIN,
    ack,
    buffer,
    get,
    lease,
    put,
    run,
    stats,
)


def _refusals(reason: str) -> float:
    return m.REJECTIONS_TOTAL.labels("PutTrajectories", reason)._value.get()


def _refused_put(redis_url: str, tmp_path: Path, reason: str, build: Any, **kw: Any) -> str:
    """Lease a prompt, put the group `build(prompt)` makes; the refusal's message after checking
    it was counted under `reason` and stored nothing."""

    async def scenario() -> tuple[str, int]:
        async with buffer(redis_url, tmp_path, **kw) as svc:
            (p,) = (await lease(svc, 1)).prompts
            group, leases, kind = build(p)
            with pytest.raises(InvalidArgument) as err:
                await put(svc, [group], leases, kind=kind)
            return err.value.message, (await stats(svc)).counters.get("train:accepted", 0)

    before = _refusals(reason)
    message, accepted = run(scenario())
    assert (_refusals(reason) - before, accepted) == (1, 0), message
    return message


def test_a_group_without_a_lease_is_refused(redis_url: str, tmp_path: Path) -> None:
    message = _refused_put(
        redis_url, tmp_path, "no_lease", lambda p: (make_group(p.prompt_id), [], TRAIN)
    )
    assert "lease_id" in message


def test_a_group_for_a_prompt_nobody_leased_is_refused(redis_url: str, tmp_path: Path) -> None:
    # Prompt train:5 is queued but not leased; the lease handle is the leased prompt's own id
    # shifted, the form a forger would guess.
    def build(p: tpb.Prompt) -> tuple[tpb.Group, list[str], int]:
        other = "train:5" if p.prompt_id != "train:5" else "train:4"
        ms, seq = p.lease_id.split("-")
        return make_group(other), [f"{ms}-{int(seq) + 50}"], TRAIN

    message = _refused_put(redis_url, tmp_path, "no_lease", build)
    assert "is not live" in message


def test_sft_groups_in_a_job_that_never_reads_them_are_refused(
    redis_url: str, tmp_path: Path
) -> None:
    # They counted against max_inflight_groups for good: leasing stopped.
    message = _refused_put(
        redis_url,
        tmp_path,
        "kind_not_read",
        lambda p: (make_group(p.prompt_id, size=2), [p.lease_id], SFT),
    )
    assert "does not read SFT groups" in message


def test_a_positive_logprob_is_refused(redis_url: str, tmp_path: Path) -> None:
    def build(p: tpb.Prompt) -> tuple[tpb.Group, list[str], int]:
        group = make_group(p.prompt_id)
        group.trajectories[0].rollout_logprobs.CopyFrom(encode_array(np.full(8, 0.5, np.float32)))
        return group, [p.lease_id], TRAIN

    assert "log-probabilities are <= 0" in _refused_put(
        redis_url, tmp_path, "positive_logprob", build
    )


@pytest.mark.parametrize(
    ("reason", "group", "job", "expected"),
    [
        pytest.param(
            "too_long",
            {"length": 60},
            {"max_sequence_tokens": 64},
            "65 prompt + response tokens, more than the model's 64 positions",
            id="a_sample_longer_than_the_models_positions",
        ),
        pytest.param(
            "empty_response",
            {"length": 0},
            {},
            "finish_reason ABORT",
            id="an_empty_response_that_was_not_aborted",
        ),
        pytest.param(
            "version_out_of_range",
            {"version": 2**62},
            {},
            str(2**62),
            id="a_version_beyond_what_redis_stores_exactly",
        ),
    ],
)
def test_a_group_no_trainer_could_use_is_refused(
    redis_url: str,
    tmp_path: Path,
    reason: str,
    group: dict[str, Any],
    job: dict[str, Any],
    expected: str,
) -> None:
    message = _refused_put(
        redis_url,
        tmp_path,
        reason,
        lambda p: (make_group(p.prompt_id, **group), [p.lease_id], TRAIN),
        **job,
    )
    assert expected in message


def test_a_group_claiming_a_version_the_trainer_has_not_reached_is_dropped_and_requeued(
    redis_url: str, tmp_path: Path
) -> None:
    # It passed the staleness filter (current - version < 0) and was trained.
    async def scenario() -> tuple[int, dict[str, int], int]:
        async with buffer(redis_url, tmp_path, prompts=1) as svc:
            (p,) = (await lease(svc, 1)).prompts
            await put(svc, [make_group(p.prompt_id, version=10**6)], [p.lease_id])
            batch = await get(svc, 1, version=3, staleness=1)
            again = (await lease(svc, 1)).prompts
            return len(batch.groups), dict(batch.dropped), len(again)

    assert run(scenario()) == (0, {"future_version": 1}, 1)


def test_only_the_trainers_consumers_read_groups(redis_url: str, tmp_path: Path) -> None:
    async def scenario() -> tuple[str, int]:
        async with buffer(redis_url, tmp_path, prompts=1) as svc:
            (p,) = (await lease(svc, 1)).prompts
            await put(svc, [make_group(p.prompt_id)], [p.lease_id])
            request = bpb.GetBatchRequest(num_groups=16, consumer="anything-else")
            with pytest.raises(InvalidArgument) as err:
                await svc.GetBatch(request, None)  # type: ignore[arg-type]
            return err.value.message, (await stats(svc)).groups_pending

    message, pending = run(scenario())
    assert ("is not the trainer's" in message, pending) == (True, 1)


def test_a_batch_redelivered_after_the_trainer_moved_on_drops_its_stale_groups(
    redis_url: str, tmp_path: Path
) -> None:
    # An unacknowledged batch came back after batch_ack_timeout_seconds and was trained with a
    # staleness of 824 against max_staleness 1.
    async def scenario() -> tuple[str, bool, int, dict[str, int], int]:
        async with buffer(redis_url, tmp_path, prompts=2, batch_ack_timeout_seconds=0.2) as svc:
            a, b = (await lease(svc, 2)).prompts
            await put(svc, [make_group(a.prompt_id, version=0)], [a.lease_id])
            await put(svc, [make_group(b.prompt_id, version=5)], [b.lease_id])
            first = await get(svc, 2, version=5, staleness=10)
            await asyncio.sleep(0.4)  # past its ack deadline, never acknowledged
            again = await get(svc, 2, version=6, staleness=1)
            await ack(svc, again.batch_id)
            return (
                again.batch_id,
                again.batch_id == first.batch_id,
                len(again.groups),
                dict(again.dropped),
                (await stats(svc)).groups_pending,
            )

    _, same, n, dropped, pending = run(scenario())
    assert (same, n, dropped, pending) == (True, 1, {"stale": 1}, 0)


def test_a_release_of_more_ids_than_one_lease_hands_out_is_invalid_not_unavailable(
    redis_url: str, tmp_path: Path
) -> None:
    async def scenario() -> str:
        async with buffer(redis_url, tmp_path, prompts=1) as svc:
            request = bpb.ReleasePromptsRequest(
                lease_ids=["1-1"] * (MAX_RELEASE_IDS + 1), consumer="r0"
            )
            with pytest.raises(InvalidArgument) as err:
                await svc.ReleasePrompts(request, None)  # type: ignore[arg-type]
            return err.value.message

    assert f"at most {MAX_RELEASE_IDS}" in run(scenario())


def test_a_policy_version_ahead_of_the_published_weights_is_refused(
    redis_url: str, tmp_path: Path
) -> None:
    # SetPolicyVersion(2**53 - 1) was accepted for good: every replica then waited
    # version_wait_seconds before each batch (3.4 -> 0.2 steps/s).
    config = tmp_path / "ws.yaml"
    config.write_text(
        json.dumps(
            {
                "job": {"name": "wsbound"},
                "weight_sync": {
                    "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
                    "snapshot_dir": str(tmp_path / "snapshots"),
                    "shm_dir": str(tmp_path / "shm"),
                },
            }
        )
    )

    async def scenario(address: str) -> tuple[str, int, int]:
        trainer = {"publish_every": 2}
        async with buffer(
            redis_url, tmp_path, trainer=trainer, endpoints={"weight_sync": address}
        ) as svc:
            set_ = svc.SetPolicyVersion
            ok = await set_(bpb.SetPolicyVersionRequest(version=2), None)  # type: ignore[arg-type]
            with pytest.raises(FailedPrecondition) as err:
                await set_(bpb.SetPolicyVersionRequest(version=2**53 - 1), None)  # type: ignore[arg-type]
            return err.value.message, ok.version, (await stats(svc)).policy_version

    with ServiceProcess.kuberl("weight_sync", config, tmp_path).wait_serving(60) as ws:
        message, ok, version = run(scenario(ws.address))
    assert ("weight-sync holds 0" in message, ok, version) == (True, 2, 2)
