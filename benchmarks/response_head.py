"""The policy's forward and backward with the head at the response positions only, against the
head at every position (what the trainer did before).

An RL loss uses the logprobs and entropies of response tokens only. The trainer's `PolicyModel`
is given the micro-batch's response positions (`MicroBatch.gather_index`) and applies the
vocabulary head there alone (docs/trainer.md); before, it applied the head at every position and
gathered the response's afterwards. Both give the same numbers and gradients
(tests/unit/test_trainer_logprobs.py). What is saved is the head's share of the work on the
prompt: a [tokens, vocabulary] product forward and two backward, and the chunked softmax passes.

The model is Qwen2-0.5B in miniature, so that it runs on a CPU in seconds with the head's share
of the FLOPs that model has (about 27%): 8 layers of hidden 256, MLP 1,408, 4 query heads and 1
key-value head of 64, a 16,384-token vocabulary, tied embeddings, fp32. One micro-batch of
`--seqs` sequences of `--seq-len` tokens, for each prompt share in `--prompt-shares` (0.25 is
`benchmarks/trainer_mfu.py`'s 512 of 2,048; 0.75 a long multi-turn context), timed in
alternating rounds in one process. The last line printed is one JSON object.

    .venv/bin/python benchmarks/response_head.py [--seq-len 1024] [--rounds 3]
    .venv/bin/python benchmarks/response_head.py --device cuda --dtype bfloat16 --qwen2-0.5b
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

MINI = {
    "vocab_size": 16_384,
    "hidden_size": 256,
    "intermediate_size": 1_408,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "tie_word_embeddings": True,
}
# Qwen2-0.5B's configuration (benchmarks/trainer_mfu.py), for a GPU.
QWEN2_05B = {
    "vocab_size": 151_936,
    "hidden_size": 896,
    "intermediate_size": 4_864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


def build(cfg: dict[str, Any], dtype: Any, device: Any, chunk: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from kuberl.trainer.engine import PolicyModel

    torch.manual_seed(0)
    config = Qwen2Config(**cfg, max_position_embeddings=32_768, attn_implementation="sdpa")
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return PolicyModel(hf, chunk_size=chunk)


def micro_batch(cfg: dict[str, Any], seqs: int, seq_len: int, prompt_len: int, device: Any) -> Any:
    """A collated micro-batch of `seqs` samples: `prompt_len` prompt and the rest response."""
    import numpy as np

    from kuberl.trainer.batching import TrainingSequence, collate

    rng = np.random.default_rng(1)
    response = seq_len - prompt_len
    samples = [
        TrainingSequence(
            rng.integers(0, cfg["vocab_size"], prompt_len),
            rng.integers(0, cfg["vocab_size"], response),
            np.ones(response, np.float32),
            index=i,
        )
        for i in range(seqs)
    ]
    return collate(samples, 0, device)


def step_fn(policy: Any, mb: Any, response_only: bool) -> Any:
    """One forward and backward of a loss on the response's logprobs and entropies."""
    from kuberl.trainer.engine import split_outputs

    def step() -> Any:
        policy.zero_grad(set_to_none=True)
        if response_only:
            lp, ent = split_outputs(policy(mb.input_ids, mb.attention_mask, mb.gather_index))
        else:  # what the trainer did before: every position, then the response's picked out
            every_lp, every_ent = split_outputs(policy(mb.input_ids, mb.attention_mask))
            lp, ent = mb.to_response(every_lp), mb.to_response(every_ent)  # [b, R] each
        loss = -((lp + 0.01 * ent) * mb.mask).sum() / mb.mask.sum()
        loss.backward()
        return loss.detach()

    return step


def machine_info() -> dict[str, Any]:
    """The machine, for the JSON line (also `activation_checkpointing.py`'s)."""
    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def timed(step: Any, sync: Any, reps: int) -> float:
    sync()
    started = time.perf_counter()
    for _ in range(reps):
        step()
    sync()
    return (time.perf_counter() - started) / reps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--seqs", type=int, default=1, help="sequences in the micro-batch")
    parser.add_argument("--prompt-shares", default="0.25,0.75")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each")
    parser.add_argument("--reps", type=int, default=2, help="steps per round")
    parser.add_argument("--chunk", type=int, default=4096, help="trainer.logprob_chunk_size")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--qwen2-0.5b", dest="full", action="store_true", help="the real size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    args = parser.parse_args()

    import torch

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cfg = QWEN2_05B if args.full else MINI

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    policy = build(cfg, dtype, device, args.chunk)
    params = sum(p.numel() for p in policy.parameters())
    head = cfg["vocab_size"] * cfg["hidden_size"]
    shares: dict[str, Any] = {}
    for share in (float(s) for s in args.prompt_shares.split(",")):
        prompt_len = max(1, min(args.seq_len - 1, round(share * args.seq_len)))
        mb = micro_batch(cfg, args.seqs, args.seq_len, prompt_len, device)
        steps = {"response_only": step_fn(policy, mb, True), "every": step_fn(policy, mb, False)}
        losses = {name: step() for name, step in steps.items()}  # also the warm-up
        if not torch.allclose(losses["response_only"], losses["every"], rtol=1e-3, atol=1e-5):
            raise AssertionError(f"the two ways give different losses: {losses}")
        runs: dict[str, list[float]] = {name: [] for name in steps}
        for i in range(args.rounds):
            for name in list(steps) if i % 2 == 0 else list(reversed(steps)):
                runs[name].append(timed(steps[name], sync, args.reps))
        ours, base = statistics.median(runs["response_only"]), statistics.median(runs["every"])
        shares[f"{share:g}"] = {
            "prompt_tokens": prompt_len,
            "response_tokens": args.seq_len - prompt_len,
            "response_only_seconds": round(ours, 4),
            "every_position_seconds": round(base, 4),
            "speedup": round(base / ours, 3),
            "rounds_seconds": {k: [round(x, 4) for x in v] for k, v in runs.items()},
        }
    result = {
        "benchmark": "response_head",
        "model": "qwen2-0.5b" if args.full else "qwen2-0.5b in miniature",
        "parameters": params,
        "head_share_of_parameters": round(head / params, 3),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": args.dtype,
        "seq_len": args.seq_len,
        "seqs": args.seqs,
        "chunk": args.chunk,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "shares": shares,
        "machine": machine_info(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
