"""The figures `kuberl run` shows and writes, computed from hand-made service answers: rates, ETA,
weight-sync latency from Prometheus histograms, and the summary's definitions."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from kuberl.local.progress import MetricsTail, Progress, Snapshot, _histogram_totals
from kuberl.local.report import build_summary, write_plots

PROMETHEUS = """\
# HELP kuberl_weight_sync_engine_update_seconds From a version's fan-out to an engine loaded
# TYPE kuberl_weight_sync_engine_update_seconds histogram
kuberl_weight_sync_engine_update_seconds_bucket{le="0.05",transport="shm"} 3.0
kuberl_weight_sync_engine_update_seconds_count{transport="shm"} 3.0
kuberl_weight_sync_engine_update_seconds_sum{transport="shm"} 0.12
kuberl_weight_sync_engine_update_seconds_count{transport="snapshot"} 1.0
kuberl_weight_sync_engine_update_seconds_sum{transport="snapshot"} 0.4
"""


def _rl_rows(n: int, total: int = 10) -> list[dict[str, float | int | str]]:
    return [
        {
            "time": 1000.0 + 2 * i,
            "kind": "rl",
            "step": i + 1,
            "total_steps": total,
            "tokens": 300.0,
            "reward/mean": 0.5,
            "batch/groups": 4.0,
            "batch/staleness_max": float(i % 2),
        }
        for i in range(n)
    ]


def _progress(clock: list[float]) -> Progress:
    return Progress("t", max_staleness=1, plain=True, out=io.StringIO(), clock=lambda: clock[0])


def test_histogram_totals_add_up_every_label_set() -> None:
    assert _histogram_totals(PROMETHEUS, "kuberl_weight_sync_engine_update_seconds") == (
        pytest.approx(0.52),
        4.0,
    )


def test_trained_tokens_per_second_and_eta_come_from_the_recent_steps() -> None:
    progress = _progress([0.0])
    progress.add_rows(_rl_rows(4))  # steps 1..4 every 2 s, 300 tokens each
    view = progress.view
    # 3 steps x 300 tokens over 6 s; 6 steps left at 2 s each.
    assert (view.trained_tps, view.eta_seconds, view.step) == (150.0, 12.0, 4)


def test_generated_tokens_per_second_is_the_sum_over_replicas_per_second() -> None:
    progress = _progress([0.0])
    for t, (a, b) in enumerate([(0, 0), (100, 50), (300, 150)]):
        progress.add_snapshot(
            Snapshot(
                time=float(t),
                replicas={
                    "rollout-0": {"policy_version": t, "generated_tokens": a},
                    "rollout-1": {"policy_version": t, "generated_tokens": b},
                },
            )
        )
    assert (progress.view.generated_tps, progress.view.replica_versions) == (
        225.0,
        {"rollout-0": 2, "rollout-1": 2},
    )


def test_weight_sync_latency_is_the_mean_over_the_window() -> None:
    progress = _progress([0.0])
    progress.add_snapshot(Snapshot(time=0.0, sync_seconds={"engine_update": (0.1, 2.0)}))
    progress.add_snapshot(Snapshot(time=1.0, sync_seconds={"engine_update": (0.4, 4.0)}))
    # (0.4 - 0.1) s over 2 more updates.
    assert progress.view.engine_update_ms == pytest.approx(150.0)


def test_the_plain_line_shows_step_eta_and_versions() -> None:
    clock = [65.0]
    progress = _progress(clock)
    progress.started = 0.0
    progress.set_phase("RL", 10)
    progress.add_rows(_rl_rows(4))
    progress.add_snapshot(
        Snapshot(time=0.0, replicas={"rollout-0": {"policy_version": 4, "generated_tokens": 0}})
    )
    line = progress.line()
    assert line.startswith("[1m05s] RL | step 4/10 eta 12s") and "rollout-0=v4" in line


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_are_the_default_unless_stdout_is_a_terminal() -> None:
    def plain(out: io.StringIO) -> bool:
        return Progress("t", max_staleness=1, out=out).plain

    assert (plain(io.StringIO()), plain(_Terminal())) == (True, False)


def test_the_plain_line_shows_reward_accuracy_buffer_staleness_rates_and_sync() -> None:
    clock = [10.0]
    progress = _progress(clock)
    progress.set_phase("RL", 10)
    progress.add_rows([{**r, "reward/accuracy": 0.75} for r in _rl_rows(4)])
    progress.add_rows([{"kind": "eval", "eval/accuracy": 0.4}])
    # 500 tokens generated in 1 s; one engine update of 60 ms
    for t, (generated, updates) in enumerate([(0, (0.1, 2.0)), (500, (0.16, 3.0))]):
        progress.add_snapshot(
            Snapshot(
                time=float(t),
                buffer={"groups_pending": 7, "prompts_leased": 3, "policy_version": 4},
                replicas={"rollout-0": {"policy_version": 4, "generated_tokens": generated}},
                sync_seconds={"engine_update": updates},
            )
        )
    line = progress.line()
    expected = ["reward 0.50 acc 0.75", "eval 0.40", "gen 500", "train 150", "buffer 7"]
    expected += ["stale 1", "rollout-0=v4", "sync 60ms"]
    assert [part for part in expected if part not in line] == [], line


def test_the_rich_panel_shows_every_live_figure() -> None:
    out = io.StringIO()
    progress = Progress("kuberl run t", max_staleness=1, plain=False, out=out, clock=lambda: 5.0)
    progress.set_phase("RL", 10)
    progress.add_rows([{**r, "reward/accuracy": 0.75} for r in _rl_rows(4)])
    # 500 tokens generated in 1 s over two replicas; one engine update of 60 ms
    for t, (generated, updates) in enumerate([(0, (0.1, 2.0)), (250, (0.16, 3.0))]):
        progress.add_snapshot(
            Snapshot(
                time=float(t),
                buffer={"groups_pending": 7, "prompts_leased": 3, "policy_version": 4},
                replicas={
                    "rollout-0": {"policy_version": 4, "generated_tokens": generated},
                    "rollout-1": {"policy_version": 3, "generated_tokens": generated},
                },
                sync_seconds={"engine_update": updates},
            )
        )
    progress.set_services({"buffer": "serving", "trainer": "starting"}, restarts=1)
    progress.render()
    progress.close()
    text = out.getvalue()
    expected = ["step 4/10", "ETA 12s", "mean 0.500", "accuracy 0.750", "generated 500"]
    expected += ["trained 150", "7 groups pending", "staleness 1 (max 1)", "rollout-0 v4"]
    expected += ["rollout-1 v3", "engine update 60 ms", "restarts 1"]
    assert [part for part in expected if part not in text] == [], text


def test_plain_mode_prints_a_line_at_most_every_plain_every_seconds() -> None:
    clock, out = [0.0], io.StringIO()
    progress = Progress(
        "t", max_staleness=1, plain=True, plain_every=10.0, out=out, clock=lambda: clock[0]
    )
    for now in (0.0, 4.0, 9.9, 10.0, 15.0, 21.0):
        clock[0] = now
        progress.render()
    progress.close()  # the final line, whenever it comes
    assert [line.split("]")[0] for line in out.getvalue().splitlines()] == [
        "[0s",
        "[10s",
        "[21s",
        "[21s",
    ]


def test_metrics_tail_returns_only_complete_new_lines(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tail = MetricsTail(path)
    path.write_text('{"step": 1}\n{"step": ')
    first = tail.read()
    with path.open("a") as f:
        f.write('2}\n{"step": 3}\n')
    assert (first, tail.read(), tail.read()) == ([{"step": 1}], [{"step": 2}, {"step": 3}], [])


def test_the_summary_follows_its_definitions() -> None:
    rows = [
        {"kind": "eval", "eval/accuracy": 0.25, "eval/groups": 8.0},
        *_rl_rows(3, total=3),
        {"kind": "eval", "eval/accuracy": 0.5, "eval/groups": 8.0},
    ]
    counters = {
        "train:leased": 20,
        "eval:leased": 16,
        "train:prompts_leased": 1,
        "eval:prompts_leased": 0,
        "train:duplicate": 2,
        "eval:duplicate": 1,
        "train:dropped:stale": 4,
    }
    summary = build_summary(
        job="t",
        status="completed",
        wall_seconds=12.34,
        group_size=8,
        max_staleness=1,
        rl_rows=rows,
        warm_rows=[],
        buffer_final={"counters": counters},
        replicas_final={},
        sync_seconds={"engine_update": (0.3, 6.0)},
        services={},
        timeline=[],
        extra={},
    )
    picked = {
        k: summary[k]
        for k in (
            "eval_accuracy_start",
            "eval_accuracy_end",
            "steps",
            "trajectories_trained",
            "prompts_leased",
            "prompts_lost",
            "groups_duplicated",
            "staleness_max",
            "seconds_per_step",
        )
    }
    assert picked == {
        "eval_accuracy_start": 0.25,
        "eval_accuracy_end": 0.5,
        "steps": 3,
        "trajectories_trained": 3 * 4 * 8,
        "prompts_leased": 20,
        "prompts_lost": 1,
        "groups_duplicated": 3,
        "staleness_max": 1.0,
        "seconds_per_step": 2.0,
    }
    assert summary["weight_sync"]["engine_update_ms_mean"] == pytest.approx(50.0)
    assert [r["step"] for r in summary["eval_rounds"]] == [0, 3]


def test_plots_are_written_even_for_a_run_without_steps(tmp_path: Path) -> None:
    paths = write_plots(tmp_path, [], [], [], title="t", max_staleness=1)
    assert sorted(p.name for p in paths) == ["reward.png", "staleness.png", "throughput.png"]


def test_steps_trained_again_after_a_resume_count_once() -> None:
    # The trainer died after step 3 and resumed from its step-1 checkpoint: steps 2 and 3 ran
    # twice, and every row once counted (9 groups x 4 x 8 trajectories instead of 4 steps' 16).
    first, second = _rl_rows(3, total=4), _rl_rows(4, total=4)[1:]
    for r in second:
        r["time"] = float(r["time"]) + 100.0
    summary = build_summary(
        job="t", status="completed", wall_seconds=1.0, group_size=8, max_staleness=1,
        rl_rows=[*first, *second], warm_rows=[], buffer_final=None, replicas_final={},
        sync_seconds={}, services={}, timeline=[], extra={},
    )  # fmt: skip
    assert (summary["steps"], summary["trajectories_trained"], summary["trained_tokens"]) == (
        4,
        4 * 4 * 8,
        4 * 300,
    )


def test_generated_tokens_add_up_across_replica_restarts_and_outages() -> None:
    # rollout-1 restarts (its counter starts again at 0) and is down for one poll: the sum of
    # the replicas' counters once fell by what its earlier life had generated.
    progress = _progress([0.0])
    polls = [(100, 50), (200, 120), (300, None), (400, 30), (500, 80)]
    for t, (a, b) in enumerate(polls):
        replicas = {
            "rollout-0": {"policy_version": t, "generated_tokens": a},
            "rollout-1": None if b is None else {"policy_version": t, "generated_tokens": b},
        }
        progress.add_snapshot(Snapshot(time=float(t), replicas=replicas))
    assert [row["generated_tokens"] for row in progress.timeline] == [150, 320, 420, 550, 700]
