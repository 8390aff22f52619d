"""summary.json sees every loss a hostile or buggy client can cause (kuberl.local.accounting).

The buffer state is real: a BufferService on an embedded Redis that the hostile request acts on,
read back with `read_buffer_state` as `kuberl run` does before Redis stops. Counting only the
leases still outstanding, summary.json said `prompts_lost: 0` after 16 groups were taken and
acknowledged by a reader that was not the trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.local.accounting import (
    prompt_accounting,
    read_buffer_state,
    staleness_trained,
    trained_lineage,
)
from kuberl.local.report import build_summary
from tests.integration.buffer_support import make_group
from tests.unit.test_buffer_logic import ack, buffer, lease, put, run


def _summary(accounting: dict[str, Any]) -> dict[str, Any]:
    return build_summary(
        job="t", status="completed", wall_seconds=1.0, group_size=4, max_staleness=1,
        rl_rows=[], warm_rows=[], buffer_final={"counters": {"train:prompts_leased": 0}},
        replicas_final={}, sync_seconds={}, services={}, timeline=[], extra={},
        accounting=accounting,
    )  # fmt: skip


def test_groups_a_batch_nobody_trained_acknowledged_are_reported_lost(
    redis_url: str, tmp_path: Path
) -> None:
    job = "acct-acked"

    async def scenario() -> None:
        async with buffer(redis_url, tmp_path, prompts=6, job=job) as svc:
            prompts = (await lease(svc, 6)).prompts
            for p in prompts[:4]:
                await put(svc, [make_group(p.prompt_id)], [p.lease_id])
            # A reader posing as the trainer takes and acknowledges them; nothing trains them.
            request = bpb.GetBatchRequest(num_groups=16, consumer="trainer", max_staleness=-1)
            taken = await svc.GetBatch(request, None)  # type: ignore[arg-type]
            batch = bpb.GetBatchResponse.FromString(taken) if isinstance(taken, bytes) else taken
            await ack(svc, batch.batch_id)

    run(scenario())
    accounting = prompt_accounting(
        read_buffer_state(redis_url, job), trained_lineage([{"event": "start", "step": 0}])
    )
    summary = _summary(accounting)
    assert (summary["prompts_lost"], summary["prompts_lost_why"], summary["prompts_pending"]) == (
        4,
        {"acknowledged_untrained": 4},
        {"total": 2, "why": {"leased": 2}},
    )


def test_groups_trained_beyond_max_staleness_are_reported() -> None:
    # An unacknowledged batch came back 300 s later and was trained 824 versions stale.
    rows = [
        {"event": "start", "step": 0},
        {"event": "step", "step": 1, "policy_version": 2, "groups": [
            {"key": "d:0@0", "version_start": 1},
        ]},
        {"event": "step", "step": 2, "policy_version": 900, "groups": [
            {"key": "d:1@0", "version_start": 75},
            {"key": "d:2@0", "version_start": 2**62},
        ]},
    ]  # fmt: skip
    summary = _summary({**staleness_trained(trained_lineage(rows), max_staleness=1)})
    assert (
        summary["groups_trained_over_max_staleness"],
        summary["staleness_trained_max"],
    ) == (2, 824)


def test_prompts_of_an_epoch_not_queued_yet_are_neither_handed_out_nor_lost(
    redis_url: str, tmp_path: Path
) -> None:
    job = "acct-partial"

    async def scenario() -> None:
        async with buffer(redis_url, tmp_path, prompts=10, job=job, queue_slice_prompts=4) as svc:
            prompts = (await lease(svc, 4)).prompts  # the first slice, all leased
            await put(svc, [make_group(prompts[0].prompt_id)], [prompts[0].lease_id])

    run(scenario())
    state = read_buffer_state(redis_url, job)
    assert state["state"]["train:fill_at"] == "4"  # 6 prompts of the epoch not queued yet
    accounting = prompt_accounting(state, trained_lineage([{"event": "start", "step": 0}]))
    summary = _summary(accounting)
    assert (summary["prompts_lost"], summary["prompts_pending"]) == (
        0,
        {"total": 4, "why": {"leased": 3, "group_untrained": 1}},
    )
