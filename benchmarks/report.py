"""`make bench`: run every CPU benchmark under benchmarks/ and write docs/benchmarks.md.

Each benchmark runs as its own process with its own defaults (`python benchmarks/<name>.py`),
one after the other; its last stdout line is its JSON result. The results are kept, one JSON
line per benchmark with when and under what load it ran, in `docs/benchmarks.jsonl`, and the
report `docs/benchmarks.md` is generated from that file: one table (figure, ours, baseline,
ratio, goal, met?, machine, date) built by a small reader per benchmark (`ROWS`), then the GPU
figures: those measured on a GPU machine (`--gpu-results`, JSON lines of the same benchmarks run
there, the device named in each) and a list of those still unmeasured.

    .venv/bin/python benchmarks/report.py                   # run everything, write the report
    .venv/bin/python benchmarks/report.py --only vs_trl     # re-run one, keep the others' lines
    .venv/bin/python benchmarks/report.py --no-run          # rewrite the report from the lines
    .venv/bin/python benchmarks/report.py --note "box shared with other test runs"

A benchmark that fails is recorded with its error (and the report says so); the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "benchmarks.jsonl"
GPU_RESULTS = REPO / "docs" / "benchmarks-gpu.jsonl"
# Every trainer_mfu line of the GPU runs (settings and compile variants), kept beside the one the
# table shows.
MFU_RUNS = REPO / "docs" / "trainer_mfu-runs.jsonl"
REPORT = REPO / "docs" / "benchmarks.md"
# Everything from this line on in the report is hand-written (analysis, profiles) and kept.
NOTES_MARKER = "<!-- hand-written notes below: report.py keeps everything after this line -->"

# The CPU benchmarks `make bench` runs, in this order, with the arguments given here (none:
# each script's own defaults). trainer_mfu reports itself skipped without a GPU.
BENCHMARKS: dict[str, list[str]] = {
    "vs_trl": [],
    "vs_trl_long": ["--task", "long"],
    "gae": [],
    "trainer_logprobs": [],
    "response_head": [],
    "activation_checkpointing": [],
    "rollout_engine": [],
    "reward_throughput": [],
    "buffer_throughput": [],
    "epoch_queue": [],
    "put_encoding": [],
    "weight_sync": [],
    "lora_sync": [],
    "scale": [],
    # Each runs only the seeded runs its results file (docs/staleness-experiments.jsonl, the
    # long task's docs/staleness-long-experiments.jsonl) lacks, about 2 min each, then
    # summarises the runs of today's settings.
    "staleness": ["--seeds", "8"],
    "staleness_long": ["--task", "long", "--seeds", "8", "--arms", "s0,s1"],
    "trainer_mfu": [],
}

# A benchmark whose script is another's, run with other arguments.
SCRIPTS: dict[str, str] = {"vs_trl_long": "vs_trl", "staleness_long": "staleness"}

# Extra arguments when this machine has CUDA (the script measures its GPU part only if asked).
GPU_ARGS: dict[str, list[str]] = {"weight_sync": ["--gpu"]}

# Figures only a GPU can give, by benchmark: what stays unmeasured until a GPU run is merged.
GPU_FIGURES: dict[str, str] = {
    "trainer_mfu": "trainer MFU, tokens/s and peak memory (Qwen2-0.5B, 2,048 tokens, ZeRO-2, "
    "bf16) against stock DeepSpeed ZeRO-2; goal 40% MFU",
    "gae": "GAE on the GPU: goal 1,000x the sequential loop at T=32k and within 5x of the "
    "memory-bandwidth bound",
    "weight_sync": "CUDA IPC update into a torch engine against a device-to-device copy; goal 2x",
    "rollout_engine": "torch engine tokens/s against model.generate on the GPU",
    "trainer_logprobs": "chunked logprobs time and memory on the GPU",
}


@dataclass
class Row:
    """One line of the report's table."""

    figure: str
    ours: str
    baseline: str
    ratio: str
    goal: str = "-"
    met: str = "-"


def _num(x: Any, digits: int = 1) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:,.{digits}f}" if isinstance(x, float) else f"{x:,}"


def _yes(flag: Any) -> str:
    return "n/a" if flag is None else ("yes" if flag else "**no**")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


# ---------------------------------------------------------------------------- readers


def rows_gae(r: dict[str, Any], gpu: bool = False) -> list[Row]:
    part = r.get("gpu" if gpu else "cpu")
    if not isinstance(part, dict):
        return []
    where = "GPU" if gpu else "CPU"
    rows = []
    sizes = sorted((k for k in part if k.startswith("T=")), key=lambda k: int(k[2:]))
    for key in sizes:
        v = part[key]
        if not isinstance(v, dict):
            continue
        goal, met = ("H100: >= 1,000x at T=32k, <= 5x bound", "n/a (GPU goal)")
        if gpu:
            goal, met = ("at T=32k", "-")
        if gpu and key == "T=32768":
            ok = v["speedup_vs_verl_loop"] >= 1000 and v["ours_over_bound"] <= 5
            goal, met = ">= 1,000x and <= 5x bound", _yes(ok)
        rows.append(
            Row(
                f"GAE B={r.get('batch', 64)} {key} ({where})",
                f"{v['ours_ms']} ms ({v['ours_over_bound']}x the bandwidth bound)",
                f"{v['verl_loop_ms']} ms (verl's sequential loop)",
                f"{v['speedup_vs_verl_loop']}x faster",
                goal,
                met,
            )
        )
    return rows


def rows_trainer_logprobs(r: dict[str, Any]) -> list[Row]:
    dtype = f", {r['dtype']}" if r.get("dtype", "float32") != "float32" else ""
    dims = f"{r['tokens']} tokens x {r['vocab']:,} vocabulary ({r.get('device', 'cpu')}{dtype})"
    return [
        Row(
            f"logprobs + entropy, fwd+bwd, peak memory, {dims}",
            f"{_mib(r['chunked_peak_bytes'])} (chunked)",
            f"{_mib(r['full_peak_bytes'])} (full logits)",
            f"{r['memory_ratio_chunked_over_full']:.2f}x",
        ),
        Row(
            f"logprobs + entropy, fwd+bwd, time, {dims}",
            f"{r['chunked_seconds']:.2f} s (chunked)",
            f"{r['full_seconds']:.2f} s (full logits)",
            f"{r['time_ratio_chunked_over_full']:.2f}x",
        ),
    ]


def rows_response_head(r: dict[str, Any]) -> list[Row]:
    where = r.get("device_name") or r.get("device", "cpu")
    out = []
    for x in r.get("shares", {}).values():
        out.append(
            Row(
                f"policy fwd+bwd, {r['model']} ({where}, {r.get('dtype', 'float32')}), "
                f"{x['prompt_tokens']:,}-token prompt + {x['response_tokens']:,}-token response",
                f"{x['response_only_seconds']:.2f} s (head at the response only)",
                f"{x['every_position_seconds']:.2f} s (head at every position)",
                f"{x['speedup']:.2f}x faster",
            )
        )
    return out


def rows_activation_checkpointing(r: dict[str, Any]) -> list[Row]:
    modes = r.get("modes", {})
    none = modes.get("none")
    if not none:
        return []
    out = []
    for name, label in (("selective", "selective"), ("whole_layers", "whole layers")):
        x = modes.get(name)
        if not x:
            continue
        out.append(
            Row(
                f"activation memory, policy fwd+bwd, {r['model']} (cpu), {r['seq_len']:,} tokens: "
                f"gradient_checkpointing {label}",
                f"{x['activation_mib']:,.0f} MiB in {x['seconds']:.2f} s",
                f"{none['activation_mib']:,.0f} MiB in {none['seconds']:.2f} s (none)",
                f"{x['memory_vs_none']:.2f}x memory, {x['time_vs_none']:.2f}x time",
            )
        )
    return out


def rows_rollout_engine(r: dict[str, Any], gpu: bool = False) -> list[Row]:
    out = []
    for x in r.get("results", []):
        if (x.get("device") == "cuda") != gpu:
            continue
        out.append(
            Row(
                f"torch rollout engine, batch {x['batch']} ({x['device']}, "
                f"{r['model']['size']} model, {r['new_tokens']} new tokens)",
                f"{_num(x['engine_tokens_per_s'])} tokens/s",
                f"{_num(x['generate_tokens_per_s'])} tokens/s (model.generate)",
                f"{x['ratio_engine_over_generate']:.2f}x",
            )
        )
    return out


def rows_reward_throughput(r: dict[str, Any]) -> list[Row]:
    out = []
    for name in ("gsm8k", "code"):
        x = r.get(name)
        if isinstance(x, dict):
            out.append(
                Row(
                    f"reward service, {name} samples/s",
                    f"{_num(x['service_samples_per_s'])}/s (gRPC service)",
                    f"{_num(x['direct_samples_per_s'])}/s (direct calls)",
                    f"{x['service_over_direct']:.2f}x",
                )
            )
    return out


def rows_buffer_throughput(r: dict[str, Any]) -> list[Row]:
    goal = r.get("goal", {})
    return [
        Row(
            "buffer: trajectories/s through one replica (2,048-token responses)",
            f"{_num(r['service_traj_per_s'])} traj/s",
            f"{_num(r['raw_redis_traj_per_s'])} traj/s (raw Redis streams)",
            f"{r['ratio_service_to_raw']:.2f}x",
            f">= {goal.get('traj_per_s', 2500):,} traj/s and >= {goal.get('ratio', 0.5)}x",
            _yes(r.get("goal_met")),
        )
    ]


def rows_epoch_queue(r: dict[str, Any]) -> list[Row]:
    sliced, whole = r["sliced"], r["whole_epoch"]
    return [
        Row(
            f"buffer: longest Redis stall queueing an epoch of {r['prompts']:,} prompts "
            f"(slices of {sliced['queue_slice_prompts']:,})",
            f"{_num(sliced['longest_redis_stall_ms'])} ms",
            f"{_num(whole['longest_redis_stall_ms'])} ms (the whole epoch in one script)",
            f"{r['ratio_stall_sliced_to_whole']:.4f}x",
            f"<= {r['goal']['longest_stall_ms']:.0f} ms",
            _yes(r.get("goal_met")),
        )
    ]


def rows_staleness(r: dict[str, Any]) -> list[Row]:
    """One row per stale arm against on-policy; the ±0.005 goal is the demo task's."""
    arms = r["arms"]
    base = arms.get("s0")
    if not base:
        return []
    demo = r.get("tasks", ["demo"]) == ["demo"]
    task = "" if demo else " (long-response task)"
    out = []
    for name, arm in arms.items():
        diff = arm.get("vs_on_policy", {}).get("final_accuracy")
        if not diff:
            continue
        stderr = diff.get("stderr")
        spread = f" ± {stderr:.3f}" if stderr is not None else ""
        out.append(
            Row(
                f"staleness{task}: final held-out accuracy at equal samples, {name} "
                f"({diff['pairs']} seeded pairs)",
                f"{arm['final_accuracy']['median']:.3f} (median)",
                f"{base['final_accuracy']['median']:.3f} (on-policy, s0)",
                f"{diff['mean']:+.3f}{spread} (paired difference)",
                "within ±0.005" if name == "s1" and demo else "-",
                _yes(r.get("goal_met")) if name == "s1" and demo else "-",
            )
        )
    return out


def rows_put_encoding(r: dict[str, Any]) -> list[Row]:
    return [
        Row(
            "rollout replica: encoding one put of 8 groups (8 x 2,048 tokens, "
            f"{r['request_bytes'] / 1e6:.1f} MB)",
            f"{r['by_group_ms_per_request']:.2f} ms, {_num(r['by_group_page_faults_per_request'])}"
            " page faults (group by group)",
            f"{r['one_piece_ms_per_request']:.2f} ms, "
            f"{_num(r['one_piece_page_faults_per_request'])} page faults (one SerializeToString)",
            f"{r['speedup']:.1f}x faster",
        )
    ]


def rows_weight_sync(r: dict[str, Any]) -> list[Row]:
    raw = r.get("baseline_raw_gloo_broadcast_pair", {}).get("seconds")
    gb = r.get("payload_gb", 1.0)
    out = []
    for transport, by_n in r.get("relay", {}).items():
        x = by_n.get("4")
        if not x:
            continue
        out.append(
            Row(
                f"weight sync {gb:.1f} GB to 4 engines over {transport}",
                f"{x['seconds']:.2f} s",
                f"{raw:.2f} s (raw gloo broadcast, 2 processes)" if raw else "n/a",
                f"{x['ratio_vs_raw_pair']:.2f}x",
                "<= 1.5x",
                _yes(x["ratio_vs_raw_pair"] <= 1.5),
            )
        )
    return out


def rows_lora_sync(r: dict[str, Any]) -> list[Row]:
    lora, full = r["lora_bytes"], r["full_bytes"]
    rank = r.get("lora", {}).get("rank", 16)
    out = [
        Row(
            f"weight update bytes, {r.get('model', 'Qwen2-0.5B')}, LoRA r={rank} on every linear",
            f"{lora / 1e6:,.1f} MB (adapters)",
            f"{full / 1e6:,.0f} MB (full model)",
            f"{100 * lora / full:.1f}%",
            "<= 5%",
            _yes(lora / full <= 0.05),
        )
    ]
    engines = {"lora_torch": "in place (torch)", "lora_sglang": "SGLang path, stand-in server"}
    for transport, x in r.get("transports", {}).items():
        for kind, how in engines.items():
            if kind not in x:
                continue
            out.append(
                Row(
                    f"weight update seconds over {transport}, LoRA r={rank}, {how}",
                    f"{x[kind]['seconds']:.3f} s",
                    f"{x['full']['seconds']:.2f} s (full model, torch engine)",
                    f"{x[kind]['seconds'] / x['full']['seconds']:.3f}x",
                )
            )
    return out


def rows_scale(r: dict[str, Any]) -> list[Row]:
    runs = r.get("runs", [])
    if not runs:
        return []
    base, top = runs[0], runs[-1]
    s = r.get("summary", {})
    goals = s.get("goals_met", {})
    n0, n = base["replicas"], top["replicas"]
    p99 = max(top["lease_ms"]["p99"], top["put_ms"]["p99"])
    out = [
        Row(
            f"scale: lease / put p99 at {n} simulated replicas",
            f"{top['lease_ms']['p99']:.1f} / {top['put_ms']['p99']:.1f} ms",
            f"{base['lease_ms']['p99']:.1f} / {base['put_ms']['p99']:.1f} ms at {n0}",
            f"{p99 / max(base['lease_ms']['p99'], base['put_ms']['p99']):.2f}x",
            "<= 50 ms",
            _yes(goals.get("p99_ms")),
        ),
        Row(
            f"scale: buffer + Redis CPU per 1,000 trajectories at {n} replicas",
            f"{_num(top['cpu_ms_per_1k_traj']['buffer_plus_redis'])} ms",
            f"{_num(base['cpu_ms_per_1k_traj']['buffer_plus_redis'])} ms at {n0}",
            f"{s.get('cpu_per_1k_ratio_largest_to_smallest', 0):.2f}x",
            "<= 1.5x",
            _yes(goals.get("cpu_ratio")),
        ),
    ]
    fan = r.get("fan_out", {})
    relay, star = fan.get("relay", {}), fan.get("star", {})
    if "4" in relay and "64" in relay:
        out.append(
            Row(
                "scale: weight-sync fan-out to 64 engines (relay tree)",
                f"{relay['64']['seconds']:.2f} s",
                f"{relay['4']['seconds']:.2f} s to 4"
                + (f"; star {star['64']['seconds']:.2f} s to 64" if "64" in star else ""),
                f"{s.get('fan_out_ratio_64_to_4', 0):.2f}x",
                "<= 3x",
                _yes(goals.get("fan_out_ratio")),
            )
        )
    two = r.get("buffers_at_largest")
    if two:
        out.append(
            Row(
                f"scale: two buffer replicas at {n} replicas (buffer-bound)",
                f"{_num(two['two']['traj_per_s'])} traj/s",
                f"{_num(two['one']['traj_per_s'])} traj/s (one replica)",
                f"{s.get('two_buffers_ratio', 0):.2f}x",
                ">= 1.7x (or the bound named in docs/scale.md)",
                _yes(goals.get("two_buffers")),
            )
        )
    return out


def rows_weight_sync_gpu(r: dict[str, Any]) -> list[Row]:
    g = r.get("gpu")
    if not isinstance(g, dict) or "skipped" in g:
        return []
    return [
        Row(
            f"weight sync by CUDA IPC, {g['bytes'] / 1e9:.1f} GB",
            f"{g['cuda_ipc_update_seconds']:.3f} s",
            f"{g['d2d_copy_seconds']:.3f} s (device-to-device copy)",
            f"{g['ratio_vs_d2d_copy']:.2f}x",
            "<= 2x",
            _yes(g.get("goal_2x_met")),
        )
    ]


def rows_vs_trl(r: dict[str, Any]) -> list[Row]:
    k, t = r["kuberl"], r["trl"]
    samples = f"{t['samples']:,} RL samples"
    reach = r.get("kuberl_seconds_to_trl_final_accuracy")
    ratio = r.get("ratio_kuberl_time_to_trl_final_over_trl_wall")
    acc = "greedy held-out accuracy"
    task = "demo GRPO"
    if r.get("task") == "long":
        task = "long-response GRPO"
        share = t.get("generation_share_of_training_loop")
        tokens = t.get("mean_completion_tokens")
        if share is not None and tokens is not None:
            task += f" ({tokens:.0f}-token responses, generation {share:.0%} of TRL's loop)"
    goal = re.search(r"<= ([0-9.]+)x", str(r.get("goal", "")))
    # Lines from before 2026-11-28 13:55 UTC ran TRL at one thread and do not say so.
    threads = t.get("torch_threads") or 1
    return [
        Row(
            f"{task}: time to TRL's final {acc} ({t['final_accuracy']:.3f})",
            f"{reach:.0f} s" if reach is not None else "not reached",
            f"{t['wall_seconds']:.0f} s (TRL GRPOTrainer, {threads} torch "
            f"thread{'s' if threads > 1 else ''})",
            f"{ratio:.2f}x" if ratio is not None else "n/a",
            f"<= {goal.group(1)}x" if goal else "<= 0.7x",
            _yes(r.get("goal_met")),
        ),
        Row(
            f"{task}: wall time for {samples}",
            f"{k['wall_seconds']:.0f} s",
            f"{t['wall_seconds']:.0f} s (TRL)",
            f"{r['ratio_wall_kuberl_over_trl']:.2f}x",
        ),
        Row(
            f"{task}: trained samples/s",
            f"{k['samples_per_second']:.0f}/s",
            f"{t['samples_per_second']:.0f}/s (TRL)",
            f"{r['ratio_samples_per_second_kuberl_over_trl']:.2f}x",
        ),
        Row(
            f"{task}: final {acc} (mean of last 3 evals)",
            f"{k['final_accuracy']:.3f}",
            f"{t['final_accuracy']:.3f} (TRL)",
            f"{k['final_accuracy'] - t['final_accuracy']:+.3f}",
        ),
        *_rows_learning_per_sample(r.get("learning_per_sample"), acc, task),
        Row(
            f"{task}: {acc} at equal wall time ({r['equal_wall_time_seconds']:.0f} s)",
            f"{k['accuracy_at_equal_wall_time']:.3f}",
            f"{t['accuracy_at_equal_wall_time']:.3f} (TRL)",
            f"{k['accuracy_at_equal_wall_time'] - t['accuracy_at_equal_wall_time']:+.3f}",
        ),
        Row(
            f"{task}: CPU seconds, all processes",
            f"{k['cpu_seconds']:.0f} s",
            f"{t['cpu_seconds']:.0f} s (TRL)",
            f"{r['ratio_cpu_seconds_kuberl_over_trl']:.2f}x",
        ),
    ]


def _rows_learning_per_sample(x: dict[str, Any] | None, acc: str, task: str) -> list[Row]:
    """The second half's accuracy: the two sides after the same trained samples."""
    if not x:
        return []
    kub, trl = x["second_half_accuracy"]["kuberl"], x["second_half_accuracy"]["trl"]
    err = x.get("second_half_difference_stderr")
    return [
        Row(
            f"{task}: {acc} over the second half of training, same samples trained "
            f"(mean of {len(kub)} pairs; one evaluation scatters by {x['eval_noise']:.3f})",
            f"{sum(kub) / len(kub):.3f}",
            f"{sum(trl) / len(trl):.3f} (TRL)",
            f"{x['second_half_difference']:+.3f}" + (f" ± {err:.3f}" if err is not None else ""),
        )
    ]


def rows_trainer_mfu(r: dict[str, Any]) -> list[Row]:
    if r.get("skipped") or r.get("dry_run"):
        return []
    s, k = r.get("stock", {}), r.get("kuberl", {})
    if "mfu" not in k:
        return []
    what = f"Qwen2-0.5B, {r['sequence_tokens']:,}-token sequences, ZeRO-2, bf16"
    return [
        Row(
            f"trainer MFU ({what})",
            f"{k['mfu']:.1%} ({mfu_settings(r)})",
            f"{s.get('mfu', 0):.1%} (stock DeepSpeed ZeRO-2)",
            f"{k['mfu'] / s['mfu']:.2f}x" if s.get("mfu") else "n/a",
            ">= 40%",
            _yes(r.get("goal_met")),
        ),
        Row(
            "trainer tokens/s",
            f"{_num(k['tokens_per_second'])}",
            f"{_num(s.get('tokens_per_second'))} (stock)",
            f"{r.get('ratio_tokens_per_second_kuberl_over_stock', 'n/a')}x",
        ),
        Row(
            "trainer peak memory",
            f"{k['peak_memory_gib']} GiB",
            f"{s.get('peak_memory_gib')} GiB (stock)",
            f"{k['peak_memory_gib'] / s['peak_memory_gib']:.2f}x"
            if s.get("peak_memory_gib")
            else "n/a",
        ),
    ]


def mfu_settings(r: dict[str, Any]) -> str:
    """kuberl's trainer settings in a trainer_mfu line, in words."""
    parts = []
    if "kuberl_micro_batch_sequences" in r:
        parts.append(f"micro-batch {r['kuberl_micro_batch_sequences']} x {r['sequence_tokens']:,}")
    if "logprob_chunk_size" in r:
        parts.append(f"chunk {r['logprob_chunk_size']:,}")
    checkpointing = r.get("gradient_checkpointing")
    if checkpointing:
        parts.append("selective checkpointing" if checkpointing == "selective" else "checkpointing")
    compiled = [
        n for n, key in (("head", "compile_logprobs"), ("layers", "compile_model")) if r.get(key)
    ]
    if compiled:
        parts.append("compiled " + " and ".join(compiled))
    return ", ".join(parts) or "defaults"


ROWS: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "gae": rows_gae,
    "trainer_logprobs": rows_trainer_logprobs,
    "response_head": rows_response_head,
    "activation_checkpointing": rows_activation_checkpointing,
    "rollout_engine": rows_rollout_engine,
    "reward_throughput": rows_reward_throughput,
    "buffer_throughput": rows_buffer_throughput,
    "epoch_queue": rows_epoch_queue,
    "staleness": rows_staleness,
    "staleness_long": rows_staleness,
    "put_encoding": rows_put_encoding,
    "weight_sync": rows_weight_sync,
    "lora_sync": rows_lora_sync,
    "scale": rows_scale,
    "vs_trl": rows_vs_trl,
    "vs_trl_long": rows_vs_trl,
    "trainer_mfu": rows_trainer_mfu,
}
GPU_ROWS: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "gae": lambda r: rows_gae(r, gpu=True),
    "rollout_engine": lambda r: rows_rollout_engine(r, gpu=True),
    "weight_sync": rows_weight_sync_gpu,
    "trainer_mfu": rows_trainer_mfu,
    "trainer_logprobs": lambda r: rows_trainer_logprobs(r) if r.get("device") == "cuda" else [],
}


# ---------------------------------------------------------------------------- running


def machine() -> str:
    """This machine in a few words (the report's machine column)."""
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:
        gpu = "no GPU"
    return f"{platform.node()}: {os.cpu_count()}-core {platform.machine()} CPU, {gpu}"


def run_one(name: str, argv: list[str], timeout: float, log_dir: Path) -> dict[str, Any]:
    """Run benchmarks/<name>.py; its last stdout line, with how and when it ran."""
    script = SCRIPTS.get(name, name)
    cmd = [sys.executable, str(REPO / "benchmarks" / f"{script}.py"), *argv]
    started = time.time()
    load = os.getloadavg()[0]
    print(f"[bench] {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
        )
        log.write_text(proc.stdout + "\n--- stderr\n" + proc.stderr)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}")
        result: dict[str, Any] = json.loads(lines[-1])
    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
        result = {"benchmark": name, "error": str(exc)[-1500:]}
    result["_run"] = {
        "command": f"python benchmarks/{script}.py {' '.join(argv)}".strip(),
        "date": datetime.datetime.fromtimestamp(started, datetime.UTC).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
        "seconds": round(time.time() - started, 1),
        "load_start": round(load, 1),
        "load_end": round(os.getloadavg()[0], 1),
        "machine": machine(),
    }
    status = "failed" if "error" in result else "done"
    print(f"[bench] {name}: {status} in {result['_run']['seconds']} s", file=sys.stderr)
    return result


def read_results(path: Path) -> dict[str, dict[str, Any]]:
    """Benchmark name -> its result line (the last one in the file wins)."""
    out: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                out[str(r.get("benchmark") or r.get("_run", {}).get("name"))] = r
    return out


def write_results(path: Path, results: dict[str, dict[str, Any]]) -> None:
    order = [n for n in BENCHMARKS if n in results] + [n for n in results if n not in BENCHMARKS]
    path.write_text("".join(json.dumps(results[n], sort_keys=True) + "\n" for n in order))


# ---------------------------------------------------------------------------- the report


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows: list[tuple[Row, str, str]]) -> list[str]:
    lines = [
        "| figure | ours | baseline | ratio | goal | met? | machine | date |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, where, date in rows:
        cells = [row.figure, row.ours, row.baseline, row.ratio, row.goal, row.met, where, date]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def _where(r: dict[str, Any]) -> str:
    run = r.get("_run", {})
    load = ""
    if "load_start" in run:
        load = f", load {run['load_start']}-{run['load_end']}"
    return f"{run.get('machine', 'unknown')}{load}"


def render(
    results: dict[str, dict[str, Any]], gpu_results: dict[str, dict[str, Any]], note: str
) -> str:
    """docs/benchmarks.md from the result lines."""
    rows: list[tuple[Row, str, str]] = []
    failed: list[str] = []
    for name in [n for n in BENCHMARKS if n in results]:
        r = results[name]
        if "error" in r:
            failed.append(f"- `{name}` failed: `{_cell(r['error'][-400:])}`")
            continue
        try:
            made = ROWS[name](r)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            failed.append(f"- `{name}`: its JSON line has a shape this report cannot read ({exc})")
            continue
        rows += [(row, _where(r), r.get("_run", {}).get("date", "")) for row in made]
    gpu_rows: list[tuple[Row, str, str]] = []
    measured_gpu = set()
    for name, r in gpu_results.items():
        reader = GPU_ROWS.get(name)
        try:
            made = reader(r) if reader and "error" not in r else []
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            failed.append(f"- `{name}` (GPU): a JSON line this report cannot read ({exc})")
            made = []
        if made:
            measured_gpu.add(name)
        gpu_rows += [(row, _where(r), r.get("_run", {}).get("date", "")) for row in made]
    unmeasured = [f"- `{n}`: {what}" for n, what in GPU_FIGURES.items() if n not in measured_gpu]

    dates = sorted(r.get("_run", {}).get("date", "") for r in results.values())
    out = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`benchmarks/report.py`) from the JSON lines in "
        "[benchmarks.jsonl](benchmarks.jsonl); do not edit by hand. Every benchmark measures "
        "kuberl against a baseline in the same run on the same machine (`benchmarks/README.md`); "
        "the ratio column is ours over the baseline unless it says otherwise.",
        "",
    ]
    if dates:
        out += [f"Last run: {dates[0]} to {dates[-1]}, on {machine()}."]
    if note:
        out += ["", f"**Conditions:** {note}"]
    out += ["", "## CPU figures", "", *table(rows), ""]
    if failed:
        out += ["Benchmarks without figures in this run:", "", *failed, ""]
    out += ["## GPU figures", ""]
    if gpu_rows:
        out += [
            "Merged from runs on a GPU machine (`--gpu-results`), the device named in the "
            "machine column:",
            "",
            *table(gpu_rows),
            "",
        ]
    if unmeasured:
        out += [
            "**Unmeasured** (not yet measured on a GPU; each benchmark measures these when "
            "CUDA is present and reports them skipped otherwise):",
            "",
            *unmeasured,
            "",
        ]
    out += [
        "## How each was run",
        "",
        *[
            f"- `{results[n]['_run']['command']}`: {results[n]['_run']['seconds']} s"
            for n in BENCHMARKS
            if n in results and "_run" in results[n]
        ],
        "",
    ]
    return "\n".join(out)


def kept_conditions(path: Path) -> str:
    """The conditions note of an existing report (what `--note` gave when its rows were run)."""
    old = path.read_text() if path.exists() else ""
    for line in old[: old.find(NOTES_MARKER)].splitlines():
        if line.startswith("**Conditions:** "):
            return line.removeprefix("**Conditions:** ")
    return ""


def kept_notes(path: Path) -> str:
    """The hand-written part of an existing report (from `NOTES_MARKER` on), or just the marker."""
    old = path.read_text() if path.exists() else ""
    at = old.find(NOTES_MARKER)
    return old[at:] if at >= 0 else NOTES_MARKER + "\n"


def _gpu_run_facts(folder: Path) -> tuple[str, str]:
    """(date, machine) of a `gpu_checks.sh` run from its env.log."""
    env = (folder / "env.log").read_text().splitlines() if (folder / "env.log").exists() else []
    date = next((x.strip() for x in env if x.strip().endswith(" UTC")), "")
    device = next((x.split(" ", 4)[4] for x in env if x.startswith("torch ") and " cuda " in x), "")
    torch_version = next((x.split()[1] for x in env if x.startswith("torch ")), "")
    commit = next((x.split()[1] for x in env if x.startswith("checkout ")), "")
    machine = f"device: {device or 'unknown GPU'}, torch {torch_version}"
    return date, machine + (f", checkout {commit}" if commit else "")


def gpu_lines_from_run(folder: Path) -> list[dict[str, Any]]:
    """The benchmark JSON lines in the logs of a `benchmarks/gpu_checks.sh` run (its $OUT
    folder), each with a `_run` record: the step's command (its "== CMD (limit Ns)" header), the
    date and the device (env.log). Lines that say they were skipped are left out."""
    date, machine = _gpu_run_facts(folder)
    found = []
    for log in sorted(folder.glob("*.log")):
        command = ""
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("== ") and line.endswith("s)") and "(limit " in line:
                command = line[3:].rsplit(" (limit ", 1)[0]
                continue
            if not line.startswith("{"):
                continue
            try:
                result = json.loads(line)
            except ValueError:
                continue
            if not isinstance(result, dict) or "benchmark" not in result or result.get("skipped"):
                continue
            result["_run"] = {
                "name": result["benchmark"],
                "command": command,
                "date": result.get("date") or date,
                "machine": machine,
            }
            found.append(result)
    return found


def merge_gpu_run(folder: Path, gpu_results: Path, mfu_runs: Path) -> list[str]:
    """Merge a `gpu_checks.sh` run into the GPU result lines; returns the benchmarks merged.

    The table shows one line per benchmark, the newest. A trainer_mfu line only replaces it if
    it measured both variants (stock and kuberl in the same run: their ratio means something),
    and of several such lines in the run, the one whose kuberl settings gave the highest MFU
    (the table names the settings); every trainer_mfu line, variants included, is appended to
    `mfu_runs`."""
    results = read_results(gpu_results)
    merged: list[str] = []
    best_mfu = -1.0
    for line in gpu_lines_from_run(folder):
        name = str(line["benchmark"])
        if name == "trainer_mfu":
            with mfu_runs.open("a") as f:
                f.write(json.dumps(line, sort_keys=True) + "\n")
            kuberl = line.get("kuberl", {})
            if not ({"stock", "kuberl"} <= line.keys() and "mfu" in kuberl):
                continue
            if kuberl["mfu"] < best_mfu:
                continue
            best_mfu = kuberl["mfu"]
        results[name] = line
        if name not in merged:
            merged.append(name)
    write_results(gpu_results, results)
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run just these")
    parser.add_argument("--skip", nargs="+", default=[], choices=list(BENCHMARKS))
    parser.add_argument("--no-run", action="store_true", help="only rewrite the report")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the JSON lines file")
    parser.add_argument("--gpu-results", type=Path, default=GPU_RESULTS)
    parser.add_argument("--out", type=Path, default=REPORT, help="the report")
    parser.add_argument(
        "--note",
        default="",
        help="conditions of the run, shown in the report (with --no-run, the report's own is kept "
        "unless given)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="per benchmark, seconds")
    parser.add_argument("--logs", type=Path, help="folder for each benchmark's output")
    parser.add_argument(
        "--merge-gpu-run",
        type=Path,
        metavar="DIR",
        help="merge the JSON lines of a benchmarks/gpu_checks.sh run (its $OUT folder) into "
        "--gpu-results (trainer_mfu lines also into --mfu-runs), then rewrite the report",
    )
    parser.add_argument("--mfu-runs", type=Path, default=MFU_RUNS)
    args = parser.parse_args(argv)
    if args.merge_gpu_run:
        merged = merge_gpu_run(args.merge_gpu_run, args.gpu_results, args.mfu_runs)
        print(f"[bench] merged GPU lines: {', '.join(merged) or 'none'}", file=sys.stderr)
        args.no_run = True

    results = read_results(args.results)
    if not args.no_run:
        names = [n for n in (args.only or BENCHMARKS) if n not in args.skip]
        logs = args.logs or Path(os.environ.get("TMPDIR", "/tmp")) / "kuberl-bench-logs"
        logs.mkdir(parents=True, exist_ok=True)
        cuda = "no GPU" not in machine()
        for name in names:
            extra = GPU_ARGS.get(name, []) if cuda else []
            results[name] = run_one(name, BENCHMARKS[name] + extra, args.timeout, logs)
            args.results.parent.mkdir(parents=True, exist_ok=True)
            write_results(args.results, results)  # after each: a later failure keeps these
    gpu = read_results(args.gpu_results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # Rewriting the report without running anything keeps the note of the run its rows are from.
    note = args.note or (kept_conditions(args.out) if args.no_run else "")
    args.out.write_text(render(results, gpu, note) + "\n" + kept_notes(args.out))
    print(f"[bench] wrote {args.out}", file=sys.stderr)
    return 1 if any("error" in results[n] for n in results) else 0


if __name__ == "__main__":
    sys.exit(main())
