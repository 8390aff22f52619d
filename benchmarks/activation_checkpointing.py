"""Activation memory and time of the policy's forward and backward under
`trainer.gradient_checkpointing`: none (the baseline), whole layers (true) and selective.

The model is the miniature of Qwen2-0.5B of `benchmarks/response_head.py` (8 layers of hidden
256, MLP 1,408, fp32), through the trainer's `PolicyModel` at the response positions. One
micro-batch of `--seqs` sequences of `--seq-len` tokens (a quarter of them prompt). Activation
memory is the peak of the tensors autograd keeps for the backward, counted by torch's
`MemTracker` (tensor bytes, not the allocator's), in a first pass of each setting; time is the
median of alternating rounds. The last line printed is one JSON object.

    .venv/bin/python benchmarks/activation_checkpointing.py [--seq-len 2048] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from response_head import MINI, build, machine_info, micro_batch, step_fn

MODES: dict[str, bool | str] = {"none": False, "whole_layers": True, "selective": "selective"}


def activation_bytes(policy: Any, step: Any) -> int:
    """Peak bytes of activations kept for the backward during one step."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(policy)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return int(next(v for k, v in peak.items() if str(k).endswith("ACT")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--seqs", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()

    import torch

    from kuberl.trainer.engine import enable_activation_checkpointing

    torch.set_num_threads(args.threads)
    prompt_len = args.seq_len // 4
    mb = micro_batch(MINI, args.seqs, args.seq_len, prompt_len, torch.device("cpu"))
    steps, memory = {}, {}
    for name, mode in MODES.items():
        policy = build(MINI, torch.float32, torch.device("cpu"), 4096)
        enable_activation_checkpointing(policy.hf, mode)
        policy.train()
        steps[name] = step_fn(policy, mb, response_only=True)  # as the trainer runs it
        memory[name] = activation_bytes(policy, steps[name])  # also the warm-up
    runs: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(args.rounds):
        for name in list(steps) if i % 2 == 0 else list(reversed(steps)):
            started = time.perf_counter()
            steps[name]()
            runs[name].append(time.perf_counter() - started)
    seconds = {name: statistics.median(r) for name, r in runs.items()}
    result = {
        "benchmark": "activation_checkpointing",
        "model": "qwen2-0.5b in miniature",
        "seq_len": args.seq_len,
        "seqs": args.seqs,
        "prompt_tokens": prompt_len,
        "threads": torch.get_num_threads(),
        "modes": {
            name: {
                "activation_mib": round(memory[name] / 2**20, 1),
                "seconds": round(seconds[name], 4),
                "memory_vs_none": round(memory[name] / memory["none"], 3),
                "time_vs_none": round(seconds[name] / seconds["none"], 3),
                "rounds_seconds": [round(x, 4) for x in runs[name]],
            }
            for name in MODES
        },
        "machine": machine_info(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
