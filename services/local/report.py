"""The end of a local run: `summary.json` and the PNG plots of the run folder.

The supervisor (`kuberl.local.supervisor`) calls `build_summary` and `write_plots` once the
services have stopped. Everything is computed from what the run wrote and the services
reported, never from estimates: the trainer's per-step JSONL (`metrics.jsonl`: rl and eval rows;
`warm-start.jsonl`: sft rows), the supervisor's once-a-second timeline of service stats
(`timeline.jsonl`), and the buffer's final counters taken after every rollout replica drained.
What each field of summary.json means: docs/local.md, "summary.json".
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kuberl.common.logs import get_logger

log = get_logger(__name__)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def eval_rounds(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """[{step, accuracy, pass_at_n, groups}] in order; step = RL steps done before the round."""
    out = []
    step = 0
    for row in rows:
        if row.get("kind") == "rl":
            step = int(row.get("step") or step)
        elif row.get("kind") == "eval":
            out.append(
                {
                    "step": step,
                    "accuracy": row.get("eval/accuracy"),
                    "groups": row.get("eval/groups"),
                    "missing_groups": row.get("eval/missing_groups"),
                    **{k: v for k, v in row.items() if k.endswith("/pass_at_n")},
                }
            )
    return out


def _counter(counters: dict[str, int], *names: str) -> int:
    return int(sum(counters.get(n, 0) for n in names))


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def rl_steps(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The RL step rows, one per step in step order: a step trained again after a trainer
    resumed from its checkpoint replaces the row of the run that died (the weights hold the
    later one)."""
    by_step = {int(r["step"]): r for r in rows if r.get("kind") == "rl" and "step" in r}
    return [by_step[k] for k in sorted(by_step)]


def _lost(accounting: dict[str, Any] | None, outstanding: int | None) -> int | None:
    """Prompts lost per the accounting (every key's fate); without it (Redis unreadable), at
    least the leases still outstanding."""
    if accounting and "prompts_lost" in accounting:
        return int(accounting["prompts_lost"])
    return outstanding


def build_summary(
    *,
    job: str,
    status: str,
    wall_seconds: float,
    group_size: int,
    max_staleness: int,
    rl_rows: Sequence[dict[str, Any]],
    warm_rows: Sequence[dict[str, Any]],
    buffer_final: dict[str, Any] | None,
    replicas_final: dict[str, dict[str, Any] | None],
    sync_seconds: dict[str, tuple[float, float]],
    services: dict[str, dict[str, Any]],
    timeline: Sequence[dict[str, Any]],
    extra: dict[str, Any],
    accounting: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """summary.json's content (see the module docstring for the definitions)."""
    steps = rl_steps(rl_rows)
    evals = eval_rounds(rl_rows)
    counters = dict((buffer_final or {}).get("counters", {}))
    outstanding = None
    if buffer_final is not None:
        outstanding = _counter(counters, "train:prompts_leased", "eval:prompts_leased")
    staleness = [
        float(r["batch/staleness_max"]) for r in steps if r.get("batch/staleness_max") is not None
    ]
    rl_times = [r["time"] for r in steps if "time" in r]
    trained_tokens = sum(float(r.get("tokens") or 0) for r in steps)
    generated = [t["generated_tokens"] for t in timeline if t.get("generated_tokens") is not None]
    gen_span = [t["time"] for t in timeline if t.get("generated_tokens") is not None]
    sync = {
        f"{k}_ms_mean": (1000 * total / count if count else None)
        for k, (total, count) in sync_seconds.items()
    }
    sync.update({f"{k}_count": int(count) for k, (_, count) in sync_seconds.items()})
    return {
        "job": job,
        "status": status,
        "wall_seconds": round(wall_seconds, 1),
        "eval_accuracy_start": evals[0]["accuracy"] if evals else None,
        "eval_accuracy_end": evals[-1]["accuracy"] if len(evals) > 1 else None,
        "eval_rounds": evals,
        "steps": int(steps[-1]["step"]) if steps else 0,
        "total_steps": int(steps[-1].get("total_steps", 0)) if steps else None,
        "warm_start_steps": int(warm_rows[-1].get("step", 0)) if warm_rows else 0,
        "warm_start_loss_end": warm_rows[-1].get("loss/sft") if warm_rows else None,
        "trajectories_trained": int(sum(float(r.get("batch/groups") or 0) for r in steps))
        * group_size,
        "prompts_leased": _counter(counters, "train:leased"),
        "eval_prompts_leased": _counter(counters, "eval:leased"),
        "prompts_lost": _lost(accounting, outstanding),
        "prompts_lost_why": (accounting or {}).get("prompts_lost_why"),
        "prompts_pending": (accounting or {}).get("prompts_pending"),
        "groups_trained_over_max_staleness": (accounting or {}).get(
            "groups_trained_over_max_staleness"
        ),
        "staleness_trained_max": (accounting or {}).get("staleness_trained_max"),
        "groups_duplicated": _counter(counters, "train:duplicate", "eval:duplicate"),
        "groups_dropped": {
            k: v for k, v in counters.items() if ":dropped" in k or k.endswith("dropped")
        },
        "staleness_max": max(staleness) if staleness else None,
        "max_staleness": max_staleness,
        "reward_mean_first_10": _mean([r.get("reward/mean") for r in steps[:10]]),
        "reward_mean_last_10": _mean([r.get("reward/mean") for r in steps[-10:]]),
        "rl_seconds": round(rl_times[-1] - rl_times[0], 1) if len(rl_times) > 1 else None,
        "seconds_per_step": (
            round((rl_times[-1] - rl_times[0]) / (len(rl_times) - 1), 3)
            if len(rl_times) > 1
            else None
        ),
        "trained_tokens": int(trained_tokens),
        "trained_tokens_per_second": (
            trained_tokens / (rl_times[-1] - rl_times[0]) if len(rl_times) > 1 else None
        ),
        "generated_tokens": int(generated[-1]) if generated else None,
        "generated_tokens_per_second": (
            (generated[-1] - generated[0]) / (gen_span[-1] - gen_span[0])
            if len(generated) > 1 and gen_span[-1] > gen_span[0]
            else None
        ),
        "weight_sync": sync,
        "replicas": replicas_final,
        "services": services,
        "buffer_counters": counters,
        **extra,
    }


def _rolling(values: Sequence[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else math.nan


def write_plots(
    run_dir: Path,
    rl_rows: Sequence[dict[str, Any]],
    warm_rows: Sequence[dict[str, Any]],
    timeline: Sequence[dict[str, Any]],
    *,
    title: str,
    max_staleness: int,
) -> list[Path]:
    """reward.png, throughput.png, staleness.png (and warm_start.png); return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    steps = rl_steps(rl_rows)
    x = [int(r.get("step", i + 1)) for i, r in enumerate(steps)]
    window = max(1, len(steps) // 15)

    # Reward and accuracy.
    fig, ax = plt.subplots(figsize=(8, 4.5))
    reward = [_num(r.get("reward/mean")) for r in steps]
    accuracy = [_num(r.get("reward/accuracy")) for r in steps]
    if steps:
        ax.plot(x, reward, color="tab:blue", alpha=0.25, linewidth=1)
        ax.plot(
            x, _rolling(reward, window), color="tab:blue", label=f"train reward (mean of {window})"
        )
        ax.plot(
            x,
            _rolling(accuracy, window),
            color="tab:green",
            linestyle="--",
            label="train accuracy (sampled)",
        )
    evals = eval_rounds(rl_rows)
    if evals:
        ax.plot(
            [e["step"] for e in evals],
            [_num(e["accuracy"]) for e in evals],
            "o-",
            color="tab:red",
            label="held-out eval accuracy",
        )
        for e in (evals[0], evals[-1]):
            ax.annotate(
                f"{_num(e['accuracy']):.2f}",
                (e["step"], _num(e["accuracy"])),
                textcoords="offset points",
                xytext=(0, 7),
                ha="center",
                color="tab:red",
            )
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if steps or evals:
        ax.legend(loc="lower right")
    ax.set_title(f"{title}: reward and accuracy")
    fig.tight_layout()
    path = run_dir / "reward.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    # Throughput.
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6))
    if steps:
        top.plot(x, [_num(r.get("tokens_per_second")) for r in steps], color="tab:purple")
    top.set_xlabel("RL step")
    top.set_ylabel("trained tokens/s")
    top.grid(alpha=0.3)
    top.set_title(f"{title}: throughput")
    t0 = timeline[0]["time"] if timeline else 0.0
    gen = [(t["time"] - t0, t["generated_tps"]) for t in timeline if t.get("generated_tps")]
    if gen:
        bottom.plot([g[0] for g in gen], [g[1] for g in gen], color="tab:orange")
    bottom.set_xlabel("seconds since RL started")
    bottom.set_ylabel("generated tokens/s (all replicas)")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    path = run_dir / "throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    # Staleness and policy versions.
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6))
    if steps:
        top.bar(x, [_num(r.get("batch/staleness_max")) for r in steps], color="tab:gray")
    top.axhline(max_staleness, color="tab:red", linestyle="--", label="max_staleness")
    top.set_xlabel("RL step")
    top.set_ylabel("max staleness in batch (versions)")
    top.legend(loc="upper right")
    top.grid(alpha=0.3)
    top.set_title(f"{title}: staleness")
    names = sorted({n for t in timeline for n in t.get("replica_versions", {})})
    times = [t["time"] - t0 for t in timeline]
    bottom.plot(
        times,
        [_num(t.get("trainer_version")) for t in timeline],
        color="black",
        label="trainer",
    )
    for name in names:
        bottom.plot(
            times,
            [_num(t.get("replica_versions", {}).get(name)) for t in timeline],
            label=name,
            alpha=0.8,
        )
    bottom.set_xlabel("seconds since RL started")
    bottom.set_ylabel("policy version")
    if timeline:
        bottom.legend(loc="upper left")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    path = run_dir / "staleness.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    if warm_rows:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.plot(
            [int(r.get("step", i + 1)) for i, r in enumerate(warm_rows)],
            [_num(r.get("loss/sft")) for r in warm_rows],
            color="tab:blue",
        )
        ax.set_xlabel("SFT step")
        ax.set_ylabel("loss (token mean NLL)")
        ax.grid(alpha=0.3)
        ax.set_title(f"{title}: warm start")
        fig.tight_layout()
        path = run_dir / "warm_start.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
