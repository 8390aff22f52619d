"""Torch rollout engine throughput against a plain `model.generate` loop, in the same run.

For batch sizes 1, 8 and 32 (sequences generated together) the script times the torch engine
(`kuberl.rollout.engine.torch_engine.TorchEngine.generate`, which also returns the logprob of
every sampled token) and Hugging Face `model.generate` on the same model, prompts, sampling
(temperature 1, no top-k / top-p) and number of new tokens (EOS ignored, so both produce exactly
batch x max_new_tokens tokens). Each figure is the median of `--repeats` timed runs after one
warm-up run. The model is kuberl's locally built Qwen2 (`kuberl.common.modelbuild`, random
weights: speed does not depend on them). CPU always; the GPU when CUDA is available, else
reported as skipped.

The last line of output is one JSON object: tokens/s of both and their ratio per batch size and
device, plus the machine. `python benchmarks/rollout_engine.py --size small --new-tokens 64`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kuberl.common.modelbuild import build_model
from kuberl.rollout.engine.base import SamplingParams
from kuberl.rollout.engine.torch_engine import TorchEngine

BATCHES = (1, 8, 32)


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_1min": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _prompts(tokenizer: Any, batch: int) -> list[list[int]]:
    texts = [f"Question {i}: what is {i} times {i + 3}? Think step by step." for i in range(batch)]
    return [tokenizer(t)["input_ids"] for t in texts]


def _time_engine(engine: TorchEngine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)

    async def go() -> float:
        started = time.perf_counter()
        out = await engine.generate(prompts, params)
        seconds = time.perf_counter() - started
        assert sum(len(s[0].token_ids) for s in out) == len(prompts) * new_tokens
        return seconds

    return asyncio.run(go())


def _time_generate(model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int) -> float:
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(model.device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **batch,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    assert out.shape[1] - batch["input_ids"].shape[1] == new_tokens
    return seconds


def _bench_device(path: Path, device: str, new_tokens: int, repeats: int) -> list[dict[str, Any]]:
    engine = TorchEngine.from_pretrained(path, device=device, max_batch_size=max(BATCHES))
    model, tokenizer = engine.model, engine.tokenizer
    rows = []
    for batch in BATCHES:
        prompts = _prompts(tokenizer, batch)
        _time_engine(engine, prompts, new_tokens)  # warm-up
        _time_generate(model, tokenizer, prompts, new_tokens)
        ours, hf = [], []
        for _ in range(repeats):  # interleaved, so machine load hits both alike
            ours.append(_time_engine(engine, prompts, new_tokens))
            hf.append(_time_generate(model, tokenizer, prompts, new_tokens))
        tokens = batch * new_tokens
        engine_tps = tokens / statistics.median(ours)
        hf_tps = tokens / statistics.median(hf)
        rows.append(
            {
                "device": device,
                "batch": batch,
                "engine_tokens_per_s": round(engine_tps, 1),
                "generate_tokens_per_s": round(hf_tps, 1),
                "ratio_engine_over_generate": round(engine_tps / hf_tps, 3),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr)
    asyncio.run(engine.close())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("tiny", "small"), default="small")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a small shared box two spinning OpenMP threads "
        "are many times slower for a model this size)",
    )
    parser.add_argument(
        "--no-cpu",
        action="store_true",
        help="only the GPU figures (the CPU ones are the report's row; a GPU machine's time is "
        "scarce)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "model", size=args.size, tokenizer="digits", seed=0)
        params = sum(p.numel() for p in TorchEngine.from_pretrained(path).model.parameters())
        results = [] if args.no_cpu else _bench_device(path, "cpu", args.new_tokens, args.repeats)
        if torch.cuda.is_available():
            results += _bench_device(path, "cuda", args.new_tokens, args.repeats)
            gpu: str = torch.cuda.get_device_name(0)
        else:
            gpu = "skipped: CUDA is not available"
    print(
        json.dumps(
            {
                "benchmark": "rollout_engine",
                "baseline": "transformers model.generate (sampling, same model/prompts/tokens)",
                "model": {"arch": "qwen2", "size": args.size, "parameters": params},
                "new_tokens": args.new_tokens,
                "repeats": args.repeats,
                "cpu_threads": args.threads,
                "results": results,
                "gpu": gpu,
                "machine": _machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
