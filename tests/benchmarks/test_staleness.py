"""benchmarks/staleness.py: every arm is a valid demo job with its staleness, loss and in-flight
bound; runs already in the results file are skipped; the summary pairs arms by seed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kuberl.common.config import parse_job_config
from tests.benchmarks import load

staleness = load("staleness")
SETTINGS = {"task": "demo", "rl_steps": 200, "eval_every": 20}


@pytest.mark.parametrize("arm", sorted(staleness.ARMS))
def test_every_arm_is_a_valid_demo_job_with_its_staleness_and_in_flight_bound(arm: str) -> None:
    job = parse_job_config(staleness.arm_job(staleness.load_demo(staleness.DEMO), arm), env={})
    want = staleness.ARMS[arm]
    assert job.trainer.max_staleness == want["max_staleness"]
    assert job.buffer.max_inflight_groups == 16 * (want["max_staleness"] + 1)
    assert job.trainer.algorithm.policy_loss == want.get("algorithm", {}).get("policy_loss", "ppo")


def _row(arm: str, seed: int, final: float, half: float, wall: float = 100.0) -> dict[str, Any]:
    return {
        "arm": arm,
        "seed": seed,
        "settings": SETTINGS,
        "final_accuracy": final,
        "second_half_accuracy": half,
        "wall_seconds": wall,
        "staleness_max": 1.0 if arm != "s0" else 0.0,
        "machine": "test",
    }


def test_runs_already_recorded_with_the_same_settings_are_skipped_and_arms_rotate() -> None:
    rows = [_row("s0", 0, 0.9, 0.9), {**_row("s1", 1, 0.9, 0.9), "settings": {"rl_steps": 6}}]
    todo = staleness.pending_runs(rows, ["s0", "s1"], range(2), SETTINGS)
    assert todo == [("s1", 0), ("s1", 1), ("s0", 1)]


def test_the_summary_pairs_each_stale_arm_with_the_on_policy_run_of_its_seed() -> None:
    # s1 - s0 by seed: final 0.92-0.90, 0.88-0.91, 0.95-0.93 = +0.02, -0.03, +0.02 (mean 0.0033,
    # sd 0.0289, stderr 0.0167); s1 has a seed (3) without an s0 run: left out of the pairs
    rows = [_row("s0", s, f, f, 100.0) for s, f in ((0, 0.90), (1, 0.91), (2, 0.93))]
    rows += [_row("s1", s, f, f, 120.0) for s, f in ((0, 0.92), (1, 0.88), (2, 0.95), (3, 0.5))]
    out = staleness.summarize(rows)
    paired = out["arms"]["s1"]["vs_on_policy"]
    assert paired["final_accuracy"]["pairs"] == 3
    assert paired["final_accuracy"]["mean"] == pytest.approx(0.0033, abs=1e-4)
    assert paired["final_accuracy"]["stderr"] == pytest.approx(0.0167, abs=1e-4)
    assert paired["ratio_wall_seconds_median"] == 1.2
    assert out["arms"]["s1"]["final_accuracy"]["n"] == 4
    assert out["arms"]["s0"]["final_accuracy"]["median"] == 0.91
    assert out["goal_met"] is True


def test_the_markdown_table_has_a_row_per_arm_with_its_paired_difference() -> None:
    rows = [_row("s0", s, 0.9, 0.9) for s in (0, 1)] + [_row("s1", 0, 0.92, 0.91)]
    table = staleness.markdown(staleness.summarize(rows)).splitlines()
    assert len(table) == 4
    assert table[3].startswith("| s1 | 1 | 0.920") and "+0.020 (median +0.020)" in table[3]


def test_the_long_task_builds_vs_trls_long_job_and_records_its_runs_apart(tmp_path: Path) -> None:
    doc, _, settings = staleness.task_job("long", tmp_path)
    long = load("vs_trl").LONG_TASK
    assert settings == {
        "task": "long",
        "rl_steps": long["rl_steps"],
        "sft_steps": long["sft_steps"],
        "eval_every": long["rl_steps"] // 10,
        "group_size": 8,
        "groups_per_step": long["groups_per_step"],
        "lr": long["lr"],
    }
    job = parse_job_config(staleness.arm_job(doc, "s1"), env={})
    assert job.rollout.sampling.max_new_tokens == long["max_new_tokens"]
    assert job.buffer.max_inflight_groups == long["groups_per_step"] * 2
    assert job.data.train[0].path == str(tmp_path / "data-long" / "train.jsonl")
    assert (tmp_path / "data-long" / "sft.jsonl").exists()
    assert staleness.RESULTS["long"] != staleness.RESULTS["demo"]
    # A demo run recorded before `--task` existed (no task in its settings) is the demo's: done
    # for the demo, not for the long task with the same arm and seed.
    _, _, demo = staleness.task_job("demo", tmp_path)
    old = {**_row("s1", 0, 0.9, 0.9), "settings": {k: v for k, v in demo.items() if k != "task"}}
    assert staleness.pending_runs([old], ["s1"], range(1), demo) == []
    assert staleness.pending_runs([old], ["s1"], range(1), settings) == [("s1", 0)]


def test_the_summary_counts_only_the_runs_of_todays_settings(tmp_path: Path, capsys) -> None:
    _, _, demo = staleness.task_job("demo", tmp_path)
    now = [{**_row(arm, 0, 0.9, 0.9), "settings": demo} for arm in ("s0", "s1")]
    older = [{**r, "settings": {**demo, "lr": demo["lr"] * 2}, "seed": 1} for r in now]
    results = tmp_path / "runs.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in now + older))
    argv = ["--summary", "--results", str(results), "--work", str(tmp_path)]
    assert staleness.main(argv) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (summary["runs"], summary["arms"]["s1"]["seeds"]) == (2, [0])


def test_a_kept_warm_start_is_reused_only_with_the_tasks_sft_steps(
    tmp_path: Path, monkeypatch
) -> None:
    made: list[int] = []

    def fake_warm_start(doc: dict[str, Any], steps: int, out: Path, timeout: float) -> Path:
        made.append(steps)
        return out / "checkpoints" / f"step-{steps:06d}" / "hf"

    monkeypatch.setattr(staleness, "warm_start", fake_warm_start)
    old = tmp_path / "warm-start" / "checkpoints" / "step-000300" / "hf"
    old.mkdir(parents=True)
    (old / "config.json").write_text("{}")
    (old.parents[1] / "latest").write_text("step-000300")
    assert staleness.task_warm_start({}, 300, tmp_path, 1.0) == old
    assert made == []
    # The task now takes 225 SFT steps: the kept export of 300 is not its warm start.
    assert staleness.task_warm_start({}, 225, tmp_path, 1.0).parent.name == "step-000225"
    assert made == [225]
