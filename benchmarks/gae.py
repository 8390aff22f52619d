"""GAE speed and accuracy: kuberl's parallel `compute_gae` against the sequential Python loop verl
uses (`for t in reversed(range(T))` over [B] tensors), measured in the same run, for B = 64 and
T in 1k, 8k, 32k, on the CPU and, when CUDA is present, on the GPU.

Also prints the memory-bandwidth lower bound: the bytes of the inputs (rewards, values fp32, mask
bool) and outputs (advantages, returns fp32) moved once, divided by the copy bandwidth measured
here, and our time's ratio to it. Accuracy is each fp32 result's largest per-row error relative
to the row's scale, against the sequential definition evaluated in float64.

    .venv/bin/python benchmarks/gae.py [--sizes 1024,8192,32768] [--batch 64] [--no-gpu]

Last line: one JSON object with every figure and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable

import torch

from kuberl.trainer.algorithms import compute_gae

GAMMA, LAM = 0.99, 0.95


def verl_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's compute_gae_advantage_return (core_algos.py), without its final whitening."""
    m = mask.to(values.dtype)
    next_values = torch.zeros_like(values[:, 0])
    last = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(values.shape[-1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_ = delta + gamma * lam * last
        next_values = values[:, t] * m[:, t] + (1 - m[:, t]) * next_values
        last = last_ * m[:, t] + (1 - m[:, t]) * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return advantages, advantages + values


def timed(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    """Best wall seconds of `repeats` calls after one warm-up call (timeit's rule: the minimum is
    the least disturbed by other load on a shared machine)."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(device: torch.device, sync: Callable[[], None], mib: int) -> float:
    """Bytes per second of a large tensor copy (read + write)."""
    src = torch.ones(mib * 1024 * 1024 // 4, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), 7, sync)
    return 2 * src.numel() * 4 / seconds


def row_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().amax(dim=-1).clamp_min(1e-30)
    return ((ours.double() - ref).abs().amax(dim=-1) / scale).max().item()


def batch(B: int, T: int, device: torch.device, holes: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=gen)
    values = torch.randn(B, T, generator=gen) + 0.5
    lengths = torch.randint(T // 2, T + 1, (B,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if holes:
        mask &= torch.rand(B, T, generator=gen) > 0.1
    return rewards.to(device), values.to(device), mask.to(device)


def run_device(device: torch.device, B: int, sizes: list[int]) -> dict[str, object]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    bandwidth = copy_bandwidth(device, sync, 1024 if device.type == "cuda" else 128)
    results: dict[str, object] = {"copy_bandwidth_gb_s": round(bandwidth / 1e9, 2)}
    for T in sizes:
        rewards, values, mask = batch(B, T, device, holes=False)
        moved = B * T * (4 + 4 + 1 + 4 + 4)  # rewards, values, mask(bool) in; adv, returns out
        bound = moved / bandwidth
        ours = timed(lambda r=rewards, v=values, m=mask: compute_gae(r, v, m, GAMMA, LAM), 7, sync)
        reference_repeats = 3 if T <= 8192 else 2
        loop = timed(
            lambda r=rewards, v=values, m=mask: verl_gae(r, v, m, GAMMA, LAM),
            reference_repeats,
            sync,
        )
        holes = batch(B, T, device, holes=True)
        ours_holes = timed(lambda h=holes: compute_gae(*h, GAMMA, LAM), 7, sync)
        truth, _ = verl_gae(rewards.double(), values.double(), mask, GAMMA, LAM)
        ours_error = row_error(compute_gae(rewards, values, mask, GAMMA, LAM)[0], truth)
        loop_error = row_error(verl_gae(rewards, values, mask, GAMMA, LAM)[0], truth)
        results[f"T={T}"] = {
            "ours_ms": round(ours * 1e3, 3),
            "ours_with_holes_ms": round(ours_holes * 1e3, 3),
            "verl_loop_ms": round(loop * 1e3, 1),
            "speedup_vs_verl_loop": round(loop / ours, 1),
            "bandwidth_bound_ms": round(bound * 1e3, 4),
            "ours_over_bound": round(ours / bound, 1),
            "ours_rel_error": float(f"{ours_error:.2e}"),
            "verl_fp32_rel_error": float(f"{loop_error:.2e}"),
        }
        print(f"{device.type} B={B} T={T}: {results[f'T={T}']}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,8192,32768")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--no-gpu", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0: torch's default; use 1 on a machine shared with other load, "
        "where OpenMP threads waiting for each other dominate every small op)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    machine = {
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    report: dict[str, object] = {
        "benchmark": "gae",
        "batch": args.batch,
        "gamma": GAMMA,
        "lam": LAM,
        "machine": machine,
        "cpu": run_device(torch.device("cpu"), args.batch, sizes),
    }
    if torch.cuda.is_available() and not args.no_gpu:
        report["gpu"] = run_device(torch.device("cuda"), args.batch, sizes)
    else:
        report["gpu"] = "skipped: no CUDA device" if not args.no_gpu else "skipped: --no-gpu"
        print(report["gpu"], flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
