"""The pieces of `kuberl run --chaos` on small inputs: the seeded fault plan, the prompt
accounting's classes (computed by hand here), the trainer-record replay across resumes, and the
supervisor killing a whole process tree (torchrun's workers live in sessions of their own)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kuberl.local.accounting import (
    eval_before_after,
    prompt_accounting,
    replica_versions,
    trained_lineage,
)
from kuberl.local.chaos import KINDS, PROFILES, ChaosMonkey
from kuberl.local.procs import ProcessGroup, ProcessSpec
from kuberl.trainer.telemetry import TrainedLog
from tests.support import process_alive

REPLICAS = ["rollout-0", "rollout-1"]


def test_the_ci_plan_kills_every_service_kind_twice_and_redis_once() -> None:
    monkey = ChaosMonkey(PROFILES["ci"], seed=3, total_steps=100, replicas=REPLICAS)
    counts = {k: sum(f.kind == k for f in monkey.faults) for k in KINDS}
    assert counts == {
        "rollout": 2,
        "reward": 2,
        "buffer": 2,
        "weight-sync": 2,
        "trainer": 2,
        "redis": 1,
    }


def test_the_long_plan_has_at_least_thirty_faults() -> None:
    assert PROFILES["long"].faults >= 30


def test_a_plan_depends_only_on_its_seed() -> None:
    def plan(seed: int) -> list[tuple[str, str, int, float]]:
        m = ChaosMonkey(PROFILES["ci"], seed=seed, total_steps=100, replicas=REPLICAS)
        return [(f.kind, f.target, f.due_step, f.delay_seconds) for f in m.faults]

    assert (plan(1) == plan(1), plan(1) == plan(2)) == (True, False)


def test_faults_are_due_in_step_order_inside_the_profiles_window() -> None:
    monkey = ChaosMonkey(PROFILES["ci"], seed=0, total_steps=200, replicas=REPLICAS)
    steps = [f.due_step for f in monkey.faults]
    assert steps == sorted(steps) and steps[0] >= 10 and steps[-1] <= 120


def test_a_fault_still_due_past_the_window_fires_at_once_once_everything_is_up() -> None:
    monkey = ChaosMonkey(PROFILES["ci"], seed=0, total_steps=100, replicas=REPLICAS)
    first = monkey.faults[0]
    late = monkey.window_end_step + 1
    monkey._last_recovery = 1000.0  # a recovery just now: inside the window this would wait
    seen = [monkey.due(late, 1000.0, all_up=False), monkey.due(late, 1000.0, all_up=True)]
    assert seen == [None, first]


def test_a_fault_waits_for_its_step_its_delay_and_every_service_up() -> None:
    monkey = ChaosMonkey(PROFILES["ci"], seed=0, total_steps=100, replicas=REPLICAS)
    first = monkey.faults[0]
    step, t0 = first.due_step, 1000.0
    seen = [
        monkey.due(step - 1, t0, all_up=True),  # step not reached
        monkey.due(step, t0, all_up=False),  # a service is down
        monkey.due(step, t0, all_up=True),  # step seen now: the delay starts
        monkey.due(step, t0 + first.delay_seconds + 0.01, all_up=True),
    ]
    expected_third = first if first.delay_seconds == 0 else None
    assert seen == [None, None, expected_third, first]


def test_a_fault_recovers_when_its_target_restarted_and_survives_after_a_trainer_step() -> None:
    monkey = ChaosMonkey(PROFILES["ci"], seed=0, total_steps=100, replicas=REPLICAS)
    fault = monkey.faults[0]
    monkey.fired(fault, pid=123, starts=1, step=fault.due_step, now=10.0)
    t = fault.target
    monkey.check_recovery({t: 1}, {t: True}, steps_done=5, now=11.0)  # not restarted yet
    still_down = monkey.in_flight is fault
    monkey.check_recovery({t: 2}, {t: True}, steps_done=5, now=12.0)
    survived_before_step = fault.survived
    monkey.check_recovery({t: 2}, {t: True}, steps_done=6, now=13.0)
    assert (still_down, fault.recovered_unix, survived_before_step, fault.survived) == (
        True,
        12.0,
        False,
        True,
    )


def _step(step: int, keys: list[str], **kw: Any) -> dict[str, Any]:
    groups = [
        {"key": k, "replica": "rollout-0", "version_start": 1, "version_end": 1} for k in keys
    ]
    return {"event": "step", "step": step, "groups": groups, **kw}


def test_a_resume_discards_the_steps_after_its_checkpoint_from_the_lineage() -> None:
    rows = [
        {"event": "start", "step": 0},
        _step(1, ["a@0"]),
        _step(2, ["b@0"]),
        _step(3, ["c@0"]),
        {"event": "start", "step": 2},  # killed after step 3, checkpoint at 2
        _step(3, ["d@0"]),
    ]
    lineage = trained_lineage(rows)
    kept = {s: [g["key"] for g in r["groups"]] for s, r in lineage["steps"].items()}
    discarded = [g["key"] for r in lineage["discarded"] for g in r["groups"]]
    assert (kept, discarded) == ({1: ["a@0"], 2: ["b@0"], 3: ["d@0"]}, ["c@0"])


def _buffer(**kw: Any) -> dict[str, Any]:
    """Redis state of a job with one dataset `d` of 8 prompts, epoch 0 queued."""
    state = {
        "state": {"train:filled": "0"},
        "datasets": {"d": {"kind": "train", "num_prompts": 8, "num_epochs": 1}},
        "prompt_entries": [],
        "last_delivered": "100-0",
        "leased_ids": set(),
        "group_keys": [],
        "accepted": {},
    }
    state.update(kw)
    return state


def test_every_handed_out_prompt_is_trained_filtered_pending_or_lost() -> None:
    buffer = _buffer(
        # d:6 leased now, d:7 never handed out (past the group's last delivered id)
        prompt_entries=[("90-0", {"p": "d:6", "e": "0"}), ("200-0", {"p": "d:7", "e": "0"})],
        leased_ids={"90-0"},
        group_keys=["d:5@0"],  # accepted, not trained yet
        accepted={
            "d:0@0": "1",
            "d:1@0": "1",
            "d:2@0": "dropped:zero_variance",
            "d:3@0": "1",
            "d:4@0": "1",
            "d:5@0": "1",
        },
    )
    rows = [
        {"event": "start", "step": 0},
        _step(1, ["d:0@0", "d:1@0"]),
        _step(2, ["d:1@0", "d:3@0"]),  # d:1 a second time: trained twice
        {"event": "start", "step": 2},
        _step(3, ["d:4@0"], rejected=[]),
        {"event": "start", "step": 2},  # step 3 (d:4) is discarded and d:4 was acked: lost
    ]
    report = prompt_accounting(buffer, trained_lineage(rows))
    assert {
        k: report[k]
        for k in (
            "prompts_handed_out",
            "prompts_trained_once",
            "groups_trained_twice",
            "prompts_filtered",
            "prompts_pending",
            "prompts_lost",
        )
    } == {
        "prompts_handed_out": 7,
        "prompts_trained_once": 2,  # d:0, d:3
        "groups_trained_twice": 1,  # d:1
        "prompts_filtered": {"total": 1, "reasons": {"zero_variance": 1}},
        "prompts_pending": {"total": 2, "why": {"leased": 1, "group_untrained": 1}},
        "prompts_lost": 1,
    }
    assert report["lost"] == [{"key": "d:4@0", "accepted": "1", "trained_in_discarded_step": True}]


def test_keys_trained_twice_count_even_when_the_buffer_state_is_missing() -> None:
    # With no datasets in the state (Redis lost its data) nothing is handed out, and a key
    # trained at steps 1 and 2 was never looked at: 0 trained twice, 0 lost.
    buffer = _buffer(prompt_entries=[], accepted={})
    buffer["datasets"] = {}
    rows = [{"event": "start", "step": 0}, _step(1, ["d:0@0"]), _step(2, ["d:0@0"])]
    report = prompt_accounting(buffer, trained_lineage(rows))
    assert (report["groups_trained_twice"], report["trained_not_handed_out"]) == (1, 1)


def test_a_delivered_entry_no_read_will_hand_out_again_is_lost() -> None:
    # At or before the group's last delivered id, not pending, not acknowledged: nothing
    # delivers it again. It was counted as "pending: requeued".
    buffer = _buffer(
        last_delivered="100-0",
        prompt_entries=[("5-0", {"p": "d:1", "e": "0"})],
        leased_ids=set(),
        accepted={f"d:{i}@0": "1" for i in range(8) if i != 1},
    )
    rows = [{"event": "start", "step": 0}, _step(1, [f"d:{i}@0" for i in range(8) if i != 1])]
    report = prompt_accounting(buffer, trained_lineage(rows))
    assert (report["prompts_lost"], report["lost"]) == (
        1,
        [{"key": "d:1@0", "accepted": None, "orphaned_entry": True}],
    )


def test_a_step_row_torn_by_a_sigkill_does_not_swallow_the_restarts_start_row(
    tmp_path: Path,
) -> None:
    # The restarted trainer appended its `start` row to the torn line: both were unreadable,
    # so the steps that died with the process stayed in the lineage.
    from kuberl.local.accounting import read_rows

    path = tmp_path / "trained.jsonl"
    lines = [{"event": "start", "step": 0}, _step(1, ["d:0@0"]), _step(2, ["d:1@0"])]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"event": "step", "st')
    TrainedLog(path, is_main=True).write({"event": "start", "step": 1})
    lineage = trained_lineage(read_rows(path))
    assert (lineage["starts"], sorted(lineage["steps"]), len(lineage["discarded"])) == (2, [1], 1)


def test_a_group_the_trainer_refused_is_filtered_with_the_trainers_reason() -> None:
    buffer = _buffer(last_delivered="0-0", prompt_entries=[], accepted={"d:0@0": "1"})
    # Only d:0 was handed out: entries of d:1..7 are still queued after the last delivered id.
    buffer["prompt_entries"] = [(f"{i}-1", {"p": f"d:{i}", "e": "0"}) for i in range(1, 8)]
    rows = [
        {"event": "start", "step": 0},
        {
            "event": "rejected",
            "step": 0,
            "groups": [],
            "rejected": [{"key": "d:0@0", "reason": "empty_prompt"}],
        },
    ]
    report = prompt_accounting(buffer, trained_lineage(rows))
    assert (report["prompts_handed_out"], report["prompts_filtered"], report["prompts_lost"]) == (
        1,
        {"total": 1, "reasons": {"trainer:empty_prompt": 1}},
        0,
    )


def test_a_replica_whose_reported_version_goes_down_is_not_monotonic() -> None:
    timeline = [
        {"replica_versions": {"rollout-0": 1, "rollout-1": 1}},
        {"replica_versions": {"rollout-0": 3, "rollout-1": None}},
        {"replica_versions": {"rollout-0": 4, "rollout-1": 0}},
    ]
    out = replica_versions(timeline, trained_lineage([]), REPLICAS)
    assert {n: v["monotonic"] for n, v in out.items()} == {"rollout-0": True, "rollout-1": False}


def test_eval_accuracy_before_the_first_fault_and_after_the_last_recovery() -> None:
    rows = [
        {"round": 0, "time": 10.0, "eval/accuracy": 0.4},
        {"round": 1, "time": 50.0, "eval/accuracy": 0.5},
        {"round": 2, "time": 90.0, "eval/accuracy": 0.6},
    ]
    out = eval_before_after(rows, first_fault=20.0, last_recovery=80.0)
    assert (out["eval_accuracy_before_faults"], out["eval_accuracy_after_faults"]) == (0.4, 0.6)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_sigkill_reaches_a_child_that_started_its_own_session(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = (
        "import signal, subprocess, sys\n"
        "p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "with open(sys.argv[1], 'w') as f:\n"
        "    f.write(str(p.pid))\n"
        "signal.pause()\n"
    )
    group = ProcessGroup(tmp_path / "logs")
    spec = ProcessSpec(
        "leader", [sys.executable, "-c", script, str(pid_file)], port_file=False, health=False
    )
    try:
        proc = group.start(spec)
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        proc.signal(9)
        deadline = time.monotonic() + 10
        while process_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        survived = process_alive(child)
    finally:
        group.stop_all(grace=2.0)
        if pid_file.exists() and pid_file.read_text() and process_alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), 9)
    assert not survived


def test_with_an_external_redis_the_plan_has_no_redis_fault() -> None:
    # Not ours to kill: the fault was "fired" without a kill, never recovered, and every fault
    # after it was skipped while the report counted it as injected.
    from kuberl.local.chaos import chaos_profile

    external = chaos_profile("ci", external_redis=True)
    embedded = chaos_profile("ci", external_redis=False)
    monkey = ChaosMonkey(external, seed=3, total_steps=400, replicas=["rollout-0", "rollout-1"])
    assert (external.redis_kills, embedded.redis_kills) == (0, 1)
    assert "redis" not in {f.kind for f in monkey.faults} and len(monkey.faults) == 10
