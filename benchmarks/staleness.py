"""Does staleness cost learning? The demo task at equal samples, on-policy against stale arms.

Every arm trains the demo of `examples/demo.yaml` (`kuberl run`: buffer, reward, weight-sync, two
rollout replicas, the trainer) for the same RL steps from the same warm start (built once, as in
`vs_trl.py`), so all arms train the same number of samples. `--task long` trains the demo's
generation-heavy variant instead (`vs_trl.long_task`: worked-step additions, up to 128 new tokens,
`vs_trl.LONG_TASK`'s batch, steps and warm start). An arm is a `trainer.max_staleness` and a
policy loss with its importance correction:

    s0            max_staleness 0 (strictly on-policy), the demo's loss: ppo + TIS (cap 2)
    s1, s2        max_staleness 1 / 2, the same loss (its TIS weight is pi_prox / pi_behav:
                  with one update per batch this is the decoupled objective with a clamped cap)
    s1-decoupled  decoupled_ppo, AReaL's form (behaviour weight masked above cap 5)
    s2-decoupled
    s1-m2po       decoupled_ppo with M2PO's second-moment mask (tau 0.04) instead of the cap
    s1-none       ppo without any correction (stale samples treated as fresh)
    s2-none

The seeds are the pairing: seed i runs every arm (the arms' order rotates from seed to seed so
that a change in the machine's load does not always hit the same arm). Each saved policy is
judged by `vs_trl.Evaluator`: greedy decoding of the 200 held-out questions, gsm8k verifier.
Per run: the final accuracy (the mean of the last three evaluations, as in vs_trl) and the mean
over the second half of training (less noisy). Over the runs: per arm the median and spread;
per stale arm the paired differences from s0 (mean, standard error, median), the issue's goal
being |s1 - s0| <= 0.005.

The script appends one JSON line per finished run to `--results` (default
docs/staleness-experiments.jsonl, for the long task docs/staleness-long-experiments.jsonl) and
skips the (arm, seed) runs already there with the same settings (the task among them), so it can
be stopped and resumed, or run for more seeds later:

    .venv/bin/python benchmarks/staleness.py --seeds 8               # every arm, seeds 0-7
    .venv/bin/python benchmarks/staleness.py --seeds 2 --arms s0,s1  # a quick subset
    .venv/bin/python benchmarks/staleness.py --task long --seeds 2 --arms s0,s1,s1-decoupled
    .venv/bin/python benchmarks/staleness.py --summary               # only summarise the file

The last line printed is one JSON object: the per-arm figures, the paired differences and the
machine.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_trl import (
    DEMO,
    REPO,
    Evaluator,
    load_demo,
    long_task,
    machine,
    read_jsonl,
    rl_settings,
    run_kuberl,
    smoothed,
    warm_start,
)

RESULTS = {
    "demo": REPO / "docs" / "staleness-experiments.jsonl",
    "long": REPO / "docs" / "staleness-long-experiments.jsonl",
}
BASELINE = "s0"
GOAL = 0.005

#: Each arm's overrides of the demo job: trainer.max_staleness and trainer.algorithm fields.
ARMS: dict[str, dict[str, Any]] = {
    "s0": {"max_staleness": 0},
    "s1": {"max_staleness": 1},
    "s2": {"max_staleness": 2},
    "s1-decoupled": {
        "max_staleness": 1,
        "algorithm": {"policy_loss": "decoupled_ppo", "importance": {"mode": "none"}},
    },
    "s2-decoupled": {
        "max_staleness": 2,
        "algorithm": {"policy_loss": "decoupled_ppo", "importance": {"mode": "none"}},
    },
    "s1-m2po": {
        "max_staleness": 1,
        "algorithm": {
            "policy_loss": "decoupled_ppo",
            "importance": {"mode": "none"},
            "decoupled": {"behaviour_cap": None, "m2_threshold": 0.04},
        },
    },
    "s1-none": {"max_staleness": 1, "algorithm": {"importance": {"mode": "none"}}},
    "s2-none": {"max_staleness": 2, "algorithm": {"importance": {"mode": "none"}}},
}
DEFAULT_ARMS = ("s0", "s1", "s2", "s1-decoupled", "s2-decoupled")


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`base` with `update` merged in, nested dicts key by key."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def arm_job(doc: dict[str, Any], arm: str) -> dict[str, Any]:
    """The demo job with `arm`'s overrides. The rollout may run `max_staleness + 1` steps of
    groups ahead: enough for the stale arms to get data that old, and for the on-policy arm the
    setting that drops nothing (docs/benchmarks.md: with the demo's 32, max_staleness 0 drops
    thousands of groups as stale and regenerates them)."""
    job = copy.deepcopy(doc)
    overrides = ARMS[arm]
    tc = job["trainer"]
    tc["max_staleness"] = overrides["max_staleness"]
    tc["algorithm"] = merge(tc.get("algorithm", {}), overrides.get("algorithm", {}))
    job["buffer"]["max_inflight_groups"] = tc["groups_per_step"] * (overrides["max_staleness"] + 1)
    return job


def run_arm(
    doc: dict[str, Any],
    arm: str,
    seed: int,
    model: Path,
    ev: Evaluator,
    start_acc: float,
    settings: dict[str, Any],
    work: Path,
    timeout: float,
) -> dict[str, Any]:
    """One `kuberl run` of `arm` with `seed`, its policies evaluated; one results line."""
    load = os.getloadavg()[0]
    job = arm_job(doc, arm)
    res = run_kuberl(
        job,
        model,
        settings["rl_steps"],
        settings["eval_every"],
        work / f"{arm}-seed{seed}",
        timeout,
        seed=seed,
    )
    curve = ev.curve(res["snapshots"], start_acc)
    smooth = smoothed(curve, 3)
    half = curve[-1]["step"] / 2
    late = [float(p["accuracy"]) for p in curve if p["step"] > half] or [curve[-1]["accuracy"]]
    return {
        "benchmark": "staleness",
        "task": settings["task"],
        "arm": arm,
        "seed": seed,
        "overrides": ARMS[arm],
        "max_inflight_groups": job["buffer"]["max_inflight_groups"],
        "settings": settings,
        "start_accuracy": start_acc,
        "final_accuracy": round(smooth[-1], 4),
        "final_accuracy_last_eval": curve[-1]["accuracy"],
        "second_half_accuracy": round(statistics.fmean(late), 4),
        "curve": curve,
        "samples": res["samples"],
        "steps": res["steps"],
        "wall_seconds": round(res["wall_seconds"], 1),
        "cpu_seconds": round(res["cpu_seconds"], 1),
        "staleness_max": res["summary"].get("staleness_max"),
        "groups_dropped": res["summary"].get("groups_dropped"),
        "load_average_start_end": [round(load, 1), round(os.getloadavg()[0], 1)],
        "machine": machine(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def task_job(
    task: str, work: Path, rl_steps: int | None = None, eval_every: int | None = None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The job every arm of `task` starts from (the long task's data generated into `work`), its
    validated RL settings (`rl_settings`), and the settings a run is recorded with: RL steps
    (default the job's), warm-start steps, the steps between saved policies (default a tenth of
    the RL steps), batch, learning rate."""
    doc = load_demo(DEMO)
    if task == "long":
        doc = long_task(doc, work)
    job = rl_settings(doc)
    steps = rl_steps or job["rl_steps"]
    settings = {
        "task": task,
        "rl_steps": steps,
        "sft_steps": job["sft_steps"],
        "eval_every": eval_every or max(1, steps // 10),
        "group_size": job["group_size"],
        "groups_per_step": job["groups_per_step"],
        "lr": job["lr"],
    }
    return doc, job, settings


def run_settings(row: dict[str, Any]) -> dict[str, Any] | None:
    """A results line's settings, the task included (lines from before `--task` are the demo's)."""
    settings = row.get("settings")
    return {"task": "demo", **settings} if settings is not None else None


def pending_runs(
    rows: list[dict[str, Any]], arms: list[str], seeds: range, settings: dict[str, Any]
) -> list[tuple[str, int]]:
    """The (arm, seed) runs still to do, seed by seed, each seed's arms in an order rotated by
    one from the previous seed's; a run in `rows` with the same settings is done."""
    done = {(r["arm"], int(r["seed"])) for r in rows if run_settings(r) == settings}
    todo = []
    for i, seed in enumerate(seeds):
        order = arms[i % len(arms) :] + arms[: i % len(arms)]
        todo += [(arm, seed) for arm in order if (arm, seed) not in done]
    return todo


def task_warm_start(doc: dict[str, Any], sft_steps: int, work: Path, timeout: float) -> Path:
    """The warm start kept in `work` if it took `sft_steps` SFT steps, else a new one: a kept
    export of another length (the task's changed since) would start every arm elsewhere."""
    from kuberl.trainer.checkpoint import tag_for

    kept = work / "warm-start" / "checkpoints" / tag_for(sft_steps) / "hf"
    if (kept / "config.json").exists():
        return kept
    return warm_start(doc, sft_steps, work / "warm-start", timeout)


# ---------------------------------------------------------------------------- summary


def _spread(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
    return {
        "n": len(values),
        "median": round(statistics.median(ordered), 4),
        "q1": round(q[0], 4),
        "q3": round(q[2], 4),
        "min": round(ordered[0], 4),
        "max": round(ordered[-1], 4),
        "mean": round(statistics.fmean(ordered), 4),
        "sd": round(statistics.stdev(ordered), 4) if len(ordered) > 1 else None,
    }


def _paired(diffs: list[float]) -> dict[str, Any]:
    n = len(diffs)
    stderr = statistics.stdev(diffs) / math.sqrt(n) if n > 1 else None
    return {
        "pairs": n,
        "mean": round(statistics.fmean(diffs), 4),
        "stderr": round(stderr, 4) if stderr is not None else None,
        "median": round(statistics.median(diffs), 4),
        "min": round(min(diffs), 4),
        "max": round(max(diffs), 4),
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: the spread of its runs' accuracies and wall time; per stale arm: the paired
    differences from the on-policy arm (same seed), accuracy and wall-time ratio."""
    by_arm: dict[str, dict[int, dict[str, Any]]] = {}
    for r in rows:
        by_arm.setdefault(r["arm"], {})[int(r["seed"])] = r
    arms: dict[str, Any] = {}
    base = by_arm.get(BASELINE, {})
    for arm, runs in sorted(by_arm.items()):
        listed = list(runs.values())
        fig: dict[str, Any] = {
            "seeds": sorted(runs),
            "final_accuracy": _spread([r["final_accuracy"] for r in listed]),
            "second_half_accuracy": _spread([r["second_half_accuracy"] for r in listed]),
            "wall_seconds_median": round(statistics.median(r["wall_seconds"] for r in listed), 1),
            "staleness_max": max((r.get("staleness_max") or 0) for r in listed),
        }
        shared = sorted(set(runs) & set(base))
        if arm != BASELINE and shared:
            fig["vs_on_policy"] = {
                key: _paired([runs[s][key] - base[s][key] for s in shared])
                for key in ("final_accuracy", "second_half_accuracy")
            }
            fig["vs_on_policy"]["ratio_wall_seconds_median"] = round(
                statistics.median(
                    runs[s]["wall_seconds"] / base[s]["wall_seconds"] for s in shared
                ),
                3,
            )
        arms[arm] = fig
    s1 = arms.get("s1", {}).get("vs_on_policy", {}).get("final_accuracy")
    tasks = sorted({(run_settings(r) or {}).get("task", "demo") for r in rows})
    return {
        # the report keeps one line per benchmark name: the long task's summary is its own
        "benchmark": "staleness_long" if tasks == ["long"] else "staleness",
        "tasks": tasks,
        "runs": len(rows),
        "arms": arms,
        "goal": f"final accuracy at equal samples, s1 - s0 within +-{GOAL}",
        "goal_met": None if s1 is None else abs(s1["mean"]) <= GOAL,
        "eval": "greedy, 200 held-out questions, gsm8k verifier; final = mean of last 3 evals",
        "machine": rows[-1]["machine"] if rows else machine(),
    }


def markdown(summary: dict[str, Any]) -> str:
    """The summary as the table docs/benchmarks.md shows."""

    def paired(fig: dict[str, Any] | None) -> str:
        if not fig:
            return "-"
        err = f" ± {fig['stderr']:.3f}" if fig["stderr"] is not None else ""
        return f"{fig['mean']:+.3f}{err} (median {fig['median']:+.3f})"

    lines = [
        "| arm | seeds | final accuracy, median [q1, q3] | 2nd half, median [q1, q3] | "
        "final - on-policy (paired) | 2nd half - on-policy (paired) | wall vs on-policy |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, fig in summary["arms"].items():
        final, half = fig["final_accuracy"], fig["second_half_accuracy"]
        vs = fig.get("vs_on_policy", {})
        lines.append(
            f"| {arm} | {len(fig['seeds'])} | {final['median']:.3f} [{final['q1']:.3f}, "
            f"{final['q3']:.3f}] | {half['median']:.3f} [{half['q1']:.3f}, {half['q3']:.3f}] | "
            f"{paired(vs.get('final_accuracy'))} | {paired(vs.get('second_half_accuracy'))} | "
            f"{vs.get('ratio_wall_seconds_median', '-')} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=8, help="seeds first-seed ... + seeds - 1")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument(
        "--task",
        choices=tuple(RESULTS),
        default="demo",
        help="demo: the demo job; long: its generation-heavy variant (vs_trl's `long_task`)",
    )
    parser.add_argument("--rl-steps", type=int, help="RL steps (default: the job's)")
    parser.add_argument(
        "--eval-every", type=int, help="steps between saved policies (default: a tenth of them)"
    )
    parser.add_argument(
        "--results", type=Path, help="JSON lines, appended (default: the task's file in docs/)"
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/kuberl-staleness"))
    parser.add_argument("--warm-start", type=Path, help="reuse this warm-start HF folder")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    parser.add_argument("--summary", action="store_true", help="only summarise --results")
    args = parser.parse_args(argv)

    results: Path = args.results or RESULTS[args.task]
    rows = read_jsonl(results) if results.exists() else []
    # Each task its own work folder: its warm start is reused only by runs of the same task.
    work = args.work if args.task == "demo" else args.work / args.task
    work.mkdir(parents=True, exist_ok=True)
    doc, job, settings = task_job(args.task, work, args.rl_steps, args.eval_every)
    if args.summary:  # the runs of today's settings: older ones (another lr, say) stay recorded
        summary = summarize([r for r in rows if run_settings(r) == settings])
        print(markdown(summary))
        print(json.dumps(summary))
        return 0
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown}; expected some of {', '.join(ARMS)}")
    model = args.warm_start or task_warm_start(doc, settings["sft_steps"], work, args.timeout)
    ev = Evaluator(model, Path(job["eval_file"]), job["max_new_tokens"])
    start_acc = ev.accuracy()
    print(f"warm start {model}: greedy accuracy {start_acc}", file=sys.stderr)
    for arm, seed in pending_runs(
        rows, arms, range(args.first_seed, args.first_seed + args.seeds), settings
    ):
        t = time.time()
        row = run_arm(doc, arm, seed, model, ev, start_acc, settings, work, args.timeout)
        results.parent.mkdir(parents=True, exist_ok=True)
        with results.open("a") as f:
            f.write(json.dumps(row) + "\n")
        rows.append(row)
        print(
            f"{arm} seed {seed}: final {row['final_accuracy']} second half "
            f"{row['second_half_accuracy']} staleness_max {row['staleness_max']} "
            f"({time.time() - t:.0f} s)",
            file=sys.stderr,
        )
    print(json.dumps(summarize([r for r in rows if run_settings(r) == settings])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
