"""Logprobs + entropy with a large vocabulary: the trainer's vocabulary-chunked head against the
full-logits computation (`log_softmax` over [N, V]), forward and backward, in the same run.

Each variant runs in its own child process so its peak resident memory (ru_maxrss) is its own;
the figure reported is the peak minus the child's resident size just before the computation.
On CUDA the same is measured with torch's peak allocated memory.

    .venv/bin/python benchmarks/trainer_logprobs.py [--tokens 2048] [--vocab 65536] [--hidden 512]
        [--device cuda --dtype bfloat16]

On CUDA each variant runs once untimed first (kernel selection, the allocator's first blocks).

Last line: one JSON object with times, peak memory, their ratios, the largest difference between
the two results, and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time


def _child(
    variant: str, n: int, v: int, h: int, chunk: int, device: str, dtype_name: str
) -> dict[str, float]:
    import torch

    from kuberl.trainer.logprobs import chunked_logprobs_and_entropy, full_logprobs_and_entropy

    dev = torch.device(device)
    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = (torch.randn(n, h, generator=g, device=dev) * 0.5).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g, device=dev) * 0.05).to(dtype).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g, device=dev)

    def compute() -> tuple[torch.Tensor, torch.Tensor]:
        if variant == "chunked":
            return chunked_logprobs_and_entropy(hidden, weight, targets, chunk)
        return full_logprobs_and_entropy(hidden @ weight.T, targets)

    if dev.type == "cuda":
        lp, ent = compute()  # warm-up: the first GEMMs pick their kernels and allocate
        (lp.sum() + 0.1 * ent.sum()).backward()
        hidden.grad = weight.grad = None
        del lp, ent
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    lp, ent = compute()
    (lp.sum() + 0.1 * ent.sum()).backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "peak_bytes": float(peak),
        "lp_checksum": float(lp.double().sum()),
        "ent_checksum": float(ent.double().sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--child", choices=("chunked", "full"))
    args = parser.parse_args()
    if args.child:
        result = _child(
            args.child, args.tokens, args.vocab, args.hidden, args.chunk, args.device, args.dtype
        )
        print(json.dumps(result))
        return
    results = {}
    for variant in ("full", "chunked"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", variant, *sys.argv[1:]],
            capture_output=True,
            text=True,
            check=True,
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    full, chunked = results["full"], results["chunked"]
    print(
        f"full logits: {full['seconds']:.2f} s, peak +{full['peak_bytes'] / 2**20:.0f} MiB; "
        f"chunked: {chunked['seconds']:.2f} s, peak +{chunked['peak_bytes'] / 2**20:.0f} MiB"
    )
    summary = {
        "benchmark": "trainer_logprobs",
        "tokens": args.tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "chunk": args.chunk,
        "device": args.device,
        "dtype": args.dtype,
        "full_logits_bytes": args.tokens * args.vocab * 4,
        "full_seconds": full["seconds"],
        "chunked_seconds": chunked["seconds"],
        "time_ratio_chunked_over_full": chunked["seconds"] / full["seconds"],
        "full_peak_bytes": full["peak_bytes"],
        "chunked_peak_bytes": chunked["peak_bytes"],
        "memory_ratio_chunked_over_full": chunked["peak_bytes"] / max(full["peak_bytes"], 1.0),
        "logprob_sum_difference": abs(full["lp_checksum"] - chunked["lp_checksum"]),
        "entropy_sum_difference": abs(full["ent_checksum"] - chunked["ent_checksum"]),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus {platform.platform()}",
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
