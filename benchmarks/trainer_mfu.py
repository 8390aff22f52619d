"""Trainer MFU on one GPU: kuberl's real RL training step against stock DeepSpeed ZeRO-2.

Model: Qwen2-0.5B's real configuration (`QWEN2_05B`: 24 layers, hidden 896, 14 heads / 2 KV
heads, vocabulary 151,936, tied embeddings; 494M parameters), randomly initialised, bf16.
Data: sequences of 2,048 tokens (a 512-token prompt and a 1,536-token response, random ids),
`--batch-seqs` sequences per optimizer step. Both variants run DeepSpeed ZeRO-2 with torch's
AdamW (no DeepSpeed op build) in their own child process, one after the other, so each has the
GPU and its peak-memory counter to itself:

- `stock`: what a user gets from the libraries' defaults: `AutoModelForCausalLM` (transformers'
  default attention, SDPA), the model's own loss (`model(input_ids, labels=...)`: full-vocabulary
  logits and cross-entropy on the response tokens), DeepSpeed's own gradient accumulation
  (`train_micro_batch_size_per_gpu` = `--micro-batch-seqs`, `engine.backward` / `engine.step` per
  micro-batch) and DeepSpeed's default ZeRO-2 settings.
- `kuberl`: the trainer's real RL step, `kuberl.trainer.rl.RLStep` on a batch of
  groups (GRPO advantages, the PPO-clip policy loss with TIS on rollout logprobs, entropies),
  through `TrainEngine` / `PolicyModel` exactly as `kuberl serve trainer` builds them: SDPA
  attention, vocabulary-chunked logprobs (`trainer.logprob_chunk_size`, no [tokens, vocab]
  logits), micro-batches by token budget (`trainer.micro_batch_tokens` = micro-batch-seqs x
  2,048), the trainer's ZeRO-2 config. `--gradient-checkpointing [selective]` turns on the
  trainer's option.

Figures per variant: tokens/s (every token of every sequence, prompt included, forward and
backward), MFU and peak allocated memory (`torch.cuda.max_memory_allocated`), over `--steps`
timed optimizer steps after `--warmup` untimed ones.

MFU = model FLOPs / (seconds x peak), peak = 989 TFLOP/s (H100/H200 SXM dense bf16). Model
FLOPs per token (`flops_per_token`, the PaLM appendix-B accounting with causal attention):

    6 * N  +  6 * L * d * T

N = every parameter (the tied embedding counted once: it is the LM head's matmul, the lookup is
free), L layers, d = heads x head_dim (the attention width), T the sequence length. 6N is a
forward (2N) and a backward (4N) matmul pass; 12 L d T would be QK^T and AV forward and
backward over the full T x T square, halved because causal attention computes half of it.
Recomputation (activation checkpointing, the chunked head's backward) is not counted: MFU
credits only the model's own FLOPs. For Qwen2-0.5B at T = 2,048: 3.23 GFLOP per token, so
60k tokens/s is 19.6% MFU and 40% needs 122k tokens/s.

Without CUDA the benchmark prints a JSON line saying it was skipped. `--dry-run` runs both
variants on the CPU (gloo, fp32) on a tiny Qwen2 configuration with short sequences: the same
code paths, for tests; its MFU is not reported (no CPU peak).

    .venv/bin/python benchmarks/trainer_mfu.py [--steps 5] [--batch-seqs 64]
    .venv/bin/python benchmarks/trainer_mfu.py --dry-run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PEAK_FLOPS = 989e12  # H100 / H200 SXM dense bf16
GOAL_MFU = 0.40

# Qwen2-0.5B's config.json (the model hub's), the architecture fields.
QWEN2_05B: dict[str, Any] = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 131072,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}
# --dry-run: the same architecture, tiny.
TINY: dict[str, Any] = {
    **QWEN2_05B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def qwen2_parameters(cfg: dict[str, Any]) -> int:
    """Parameters of a Qwen2 causal LM with this config (q/k/v biases, RMSNorm weights)."""
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    head_dim = h // heads
    attn = h * h + h + 2 * (h * kv * head_dim + kv * head_dim) + h * h  # q (+b), k v (+b), o
    mlp = 3 * h * i
    layer = attn + mlp + 2 * h  # two RMSNorms
    head = 0 if cfg["tie_word_embeddings"] else v * h
    return v * h + n * layer + h + head  # embeddings, layers, final norm, untied head


def flops_per_token(cfg: dict[str, Any], seq_len: int, n_params: int | None = None) -> float:
    """Model FLOPs of one trained token (forward + backward), see the module docstring."""
    n = qwen2_parameters(cfg) if n_params is None else n_params
    attention_width = cfg["hidden_size"]  # heads x head_dim
    return 6.0 * n + 6.0 * cfg["num_hidden_layers"] * attention_width * seq_len


# ---------------------------------------------------------------------------- child: one variant


def _model(cfg: dict[str, Any], dtype: Any, seed: int, device: Any) -> Any:
    """The randomly initialised model, built on `device` (initialising 494M parameters on the
    host takes longer than the whole timed run on a GPU)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(Qwen2Config(**cfg), dtype=dtype)


def _token_batch(spec: dict[str, Any]) -> Any:
    """[batch_seqs, seq_len] random token ids (the same for both variants)."""
    import torch

    g = torch.Generator().manual_seed(spec["seed"])
    return torch.randint(
        0, spec["config"]["vocab_size"], (spec["batch_seqs"], spec["seq_len"]), generator=g
    )


class _Clock:
    """Wall time of the timed steps (CUDA-synchronised) and peak memory."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int | None:
        import torch

        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return None


def _time_steps(step: Any, spec: dict[str, Any], clock: _Clock) -> dict[str, Any]:
    for _ in range(spec["warmup"]):
        step()
    clock.sync()
    clock.reset_peak()
    started = time.perf_counter()
    for _ in range(spec["steps"]):
        step()
    clock.sync()
    seconds = time.perf_counter() - started
    tokens = spec["steps"] * spec["batch_seqs"] * spec["seq_len"]
    out = {"seconds": seconds, "tokens": tokens, "peak_bytes": clock.peak_bytes()}
    if spec.get("profile_dir"):
        out["profile"] = _profile_step(step, spec, clock)
    return out


def _profile_step(step: Any, spec: dict[str, Any], clock: _Clock) -> dict[str, Any]:
    """One more step under torch.profiler: its kernel and operator tables go to
    `<profile_dir>/profile-<variant>.txt`; returns the step's wall time and its kernel time
    (summed over kernels, so overlapping streams can make it exceed the wall time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if clock.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    clock.sync()
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        step()
        clock.sync()
        wall = time.perf_counter() - started
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events)
    by_device = "self_device_time_total" if clock.device.type == "cuda" else "self_cpu_time_total"
    path = Path(spec["profile_dir"]) / f"profile-{spec['variant']}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"variant {spec['variant']}: one step, {wall:.3f} s wall, {device_us / 1e6:.3f} s of "
        f"kernels (torch {torch.__version__})\n\n"
        + events.table(sort_by=by_device, row_limit=40)
        + "\n\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=25)
    )
    return {"wall_seconds": round(wall, 4), "kernel_seconds": round(device_us / 1e6, 4)}


def run_stock(spec: dict[str, Any]) -> dict[str, Any]:
    """Stock DeepSpeed ZeRO-2 on the HF model and its own loss."""
    import deepspeed
    import torch

    from kuberl.trainer.distributed import init_distributed

    info = init_distributed()  # a world of one: _child strips torchrun's variables
    dtype = torch.bfloat16 if info.device.type == "cuda" else torch.float32
    model = _model(spec["config"], dtype, spec["seed"], info.device)
    n_params = sum(p.numel() for p in model.parameters())
    mb = spec["micro_batch_seqs"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config={
            "train_micro_batch_size_per_gpu": mb,
            "gradient_accumulation_steps": spec["batch_seqs"] // mb,
            "gradient_clipping": 1.0,
            "bf16": {"enabled": dtype == torch.bfloat16},
            "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
        },
    )
    ids = _token_batch(spec).to(info.device)
    labels = ids.clone()
    labels[:, : spec["prompt_len"]] = -100  # the loss on the response, as in RL

    def step() -> None:
        for start in range(0, spec["batch_seqs"], mb):
            out = engine(input_ids=ids[start : start + mb], labels=labels[start : start + mb])
            engine.backward(out.loss)
            engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary

    result = _time_steps(step, spec, _Clock(info.device))
    return {**result, "parameters": n_params}


def run_kuberl(spec: dict[str, Any]) -> dict[str, Any]:
    """kuberl's trainer: `RLStep` on groups of trajectories, as in a real job."""
    import numpy as np

    from kuberl.common.config import parse_job_config
    from kuberl.common.trajectory import Group, Trajectory
    from kuberl.trainer.batch import Batch
    from kuberl.trainer.distributed import init_distributed
    from kuberl.trainer.engine import (
        TrainEngine,
        build_policy,
        enable_activation_checkpointing,
        train_dtype,
    )
    from kuberl.trainer.models import Models
    from kuberl.trainer.rl import RLStep
    from kuberl.trainer.sft import samples_from_groups

    info = init_distributed()  # a world of one: _child strips torchrun's variables
    config = parse_job_config(
        {
            "model": {"dtype": "bfloat16"},
            "rollout": {"group_size": spec["group_size"]},
            "trainer": {
                "zero_stage": 2,
                "groups_per_step": spec["batch_seqs"] // spec["group_size"],
                "micro_batch_tokens": spec["kuberl_micro_batch_seqs"] * spec["seq_len"],
                "logprob_chunk_size": spec["chunk"],
                "compile_logprobs": spec["compile_logprobs"],
                "compile_model": spec["compile_model"],
                "gradient_checkpointing": spec["gradient_checkpointing"],
                "optimizer": {"lr": 1e-6},
                "algorithm": {"advantage": "grpo", "clip_low": 0.2, "clip_high": 0.28},
            },
        },
        env={},
    )
    dtype = train_dtype(config.model, info.device)
    hf = _model(spec["config"], dtype, spec["seed"], info.device)
    enable_activation_checkpointing(hf, spec["gradient_checkpointing"])
    n_params = sum(p.numel() for p in hf.parameters())
    models = Models(vocab_size=spec["config"]["vocab_size"])
    models.policy = TrainEngine(build_policy(hf, config.trainer), config.trainer, info, dtype)
    rl_step = RLStep(config, models, info)

    ids = _token_batch(spec).numpy().astype(np.int32)
    rng = np.random.default_rng(spec["seed"])
    p, r = spec["prompt_len"], spec["seq_len"] - spec["prompt_len"]
    groups = []
    for g in range(spec["batch_seqs"] // spec["group_size"]):
        trajs = []
        for j in range(spec["group_size"]):
            row = ids[g * spec["group_size"] + j]
            trajs.append(
                Trajectory(
                    prompt_token_ids=row[:p],
                    response_token_ids=row[p:],
                    rollout_logprobs=(-rng.random(r) * 5).astype(np.float32),
                    loss_mask=np.ones(r, dtype=np.uint8),
                    prompt_id=f"p{g}",
                    group_id=f"g{g}",
                    sample_index=j,
                    reward=float(rng.random() < 0.5),
                )
            )
        groups.append(Group(prompt_id=f"p{g}", epoch=0, trajectories=trajs, group_id=f"g{g}"))

    def step() -> None:
        batch = Batch(samples=samples_from_groups(groups), groups=groups)
        rl_step(batch, step=0, policy_version=0)  # the trainer's own step: advantages, update

    result = _time_steps(step, spec, _Clock(info.device))
    return {**result, "parameters": n_params}


# ---------------------------------------------------------------------------- parent


def _child(variant: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if spec["dry_run"]:
        env["CUDA_VISIBLE_DEVICES"] = ""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", variant, json.dumps(spec)]
    proc = subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
    return dict(json.loads(lines[-1]))


def _figures(res: dict[str, Any], spec: dict[str, Any], peak: float | None) -> dict[str, Any]:
    if "error" in res:
        return res
    tps = res["tokens"] / res["seconds"]
    fpt = flops_per_token(spec["config"], spec["seq_len"], res["parameters"])
    out: dict[str, Any] = {
        "tokens_per_second": round(tps, 1),
        "seconds_per_step": round(res["seconds"] / spec["steps"], 4),
        "mfu": round(tps * fpt / peak, 4) if peak else None,
        "peak_memory_gib": round(res["peak_bytes"] / 2**30, 2) if res["peak_bytes"] else None,
        "parameters": res["parameters"],
    }
    if "profile" in res:
        out["profile"] = res["profile"]
    return out


def machine(device: str) -> str:
    return (
        f"{platform.node()}: {device}; {os.cpu_count()} CPU cores, {platform.machine()}, "
        f"Python {platform.python_version()}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--batch-seqs", type=int, default=64, help="sequences per step")
    parser.add_argument("--micro-batch-seqs", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument(
        "--kuberl-micro-batch-seqs",
        type=int,
        help="kuberl's micro-batch (its token budget is this x --seq-len); default: "
        "--micro-batch-seqs. Chunked logprobs keep no [tokens, vocab] logits, so kuberl fits "
        "larger micro-batches than the stock loss in the same memory",
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=4096, help="trainer.logprob_chunk_size")
    parser.add_argument(
        "--gradient-checkpointing",
        nargs="?",
        const=True,
        default=False,
        choices=[True, "selective"],
        help="trainer.gradient_checkpointing: whole layers, or 'selective'",
    )
    parser.add_argument(
        "--compile-model",
        action="store_true",
        help="trainer.compile_model: torch.compile each decoder layer (regional compilation)",
    )
    parser.add_argument(
        "--compile-logprobs",
        action="store_true",
        help="trainer.compile_logprobs: fuse the logprob head's per-chunk work (torch.compile)",
    )
    parser.add_argument("--variants", nargs="+", default=["stock", "kuberl"])
    parser.add_argument(
        "--profile-dir",
        help="after the timed steps, profile one more step of each variant (torch.profiler) and "
        "write its kernel and operator tables to <dir>/profile-<variant>.txt",
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny config on the CPU")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.spec)
        run = {"stock": run_stock, "kuberl": run_kuberl}[args.child]
        print(json.dumps(run(spec)), flush=True)
        from kuberl.trainer.distributed import leave

        leave(0)  # not the interpreter's exit: see `leave`

    import torch

    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    base = {"benchmark": "trainer_mfu", "date": date, "goal": {"mfu": GOAL_MFU}}
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print(
            json.dumps(
                {
                    **base,
                    "skipped": True,
                    "reason": "no CUDA device: trainer MFU is a GPU figure (--dry-run runs the "
                    "code paths on the CPU)",
                    "machine": machine("no GPU"),
                }
            )
        )
        return 0
    spec: dict[str, Any] = {
        "config": TINY if args.dry_run else QWEN2_05B,
        "seq_len": 64 if args.dry_run else args.seq_len,
        "prompt_len": 16 if args.dry_run else args.prompt_len,
        "batch_seqs": 8 if args.dry_run else args.batch_seqs,
        "micro_batch_seqs": 4 if args.dry_run else args.micro_batch_seqs,
        "kuberl_micro_batch_seqs": 4
        if args.dry_run
        else args.kuberl_micro_batch_seqs or args.micro_batch_seqs,
        "group_size": 4 if args.dry_run else args.group_size,
        "chunk": 128 if args.dry_run else args.chunk,
        "steps": 1 if args.dry_run else args.steps,
        "warmup": 1 if args.dry_run else args.warmup,
        "gradient_checkpointing": args.gradient_checkpointing,
        "compile_logprobs": args.compile_logprobs,
        "compile_model": args.compile_model,
        "dry_run": args.dry_run,
        "seed": 0,
        "profile_dir": str(Path(args.profile_dir).resolve()) if args.profile_dir else None,
    }
    if spec["batch_seqs"] % spec["micro_batch_seqs"] or spec["batch_seqs"] % spec["group_size"]:
        parser.error("--batch-seqs must be a multiple of --micro-batch-seqs and --group-size")
    device = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    peak = None if args.dry_run else PEAK_FLOPS
    results = {
        v: _figures(_child(v, {**spec, "variant": v}, args.timeout), spec, peak)
        for v in args.variants
    }
    out: dict[str, Any] = {
        **base,
        "dry_run": args.dry_run,
        **results,
        "flops_per_token": flops_per_token(spec["config"], spec["seq_len"]),
        "peak_flops": PEAK_FLOPS,
        "sequence_tokens": spec["seq_len"],
        "batch_sequences": spec["batch_seqs"],
        "micro_batch_sequences": spec["micro_batch_seqs"],
        "kuberl_micro_batch_sequences": spec["kuberl_micro_batch_seqs"],
        "logprob_chunk_size": spec["chunk"],
        "gradient_checkpointing": spec["gradient_checkpointing"],
        "compile_logprobs": spec["compile_logprobs"],
        "compile_model": spec["compile_model"],
    }
    stock, ours = results.get("stock", {}), results.get("kuberl", {})
    if "tokens_per_second" in stock and "tokens_per_second" in ours:
        out["ratio_tokens_per_second_kuberl_over_stock"] = round(
            ours["tokens_per_second"] / stock["tokens_per_second"], 3
        )
    if ours.get("mfu") is not None:
        out["goal_met"] = ours["mfu"] >= GOAL_MFU
    out["machine"] = machine(device)
    print(json.dumps(out))
    return 0 if not any("error" in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
