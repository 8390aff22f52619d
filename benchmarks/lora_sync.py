"""LoRA weight-sync benchmark: bytes and seconds per weight update when a job trains LoRA adapters
(r=16 on every linear layer) against full training, on a Qwen2-0.5B-shaped model (bf16, random
values, built here), through the real weight-sync service (`kuberl serve weight_sync` in a
subprocess) to one engine process, from `publish` until the engine reports the version loaded.

The baseline is the full model's update, measured in the same run the same way (the engine of
benchmarks/weight_sync.py: the torch engine's `load_state(borrow=True)` into the model's
parameters). The LoRA version carries the adapter tensors only (named as in the PEFT-injected
model), and two engines load it: `lora_torch`, the same `load_state` into the adapter parameters
(an engine that applies adapters in place), and `lora_sglang`, an SGLang replica's path
(`SGLangEngine.load_adapter`: the PEFT folder written, then `/load_lora_adapter`) against the
SGLang API STAND-IN of tests/integration/sglang_standin.py, which reads the folder back but is not
SGLang (no GPU here: SGLang's own load into its adapter memory pool is not measured). Transports:
shm (the engine on the weight-sync host) and snapshot (a chunked gRPC download, as a rollout pod
on another host gets a version). Goal (issue #28): a LoRA update moves <= 5% of the full model's
bytes. Prints one JSON object as its last line.

    .venv/bin/python benchmarks/lora_sync.py [--rank 16] [--transports shm snapshot] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import platform
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.weight_sync import qwen05b_shapes, relay_run  # noqa: E402

#: Qwen2-0.5B's decoder linears: (module path in a layer, in features, out features).
LINEARS = (
    ("self_attn.q_proj", 896, 896),
    ("self_attn.k_proj", 896, 128),
    ("self_attn.v_proj", 896, 128),
    ("self_attn.o_proj", 896, 896),
    ("mlp.gate_proj", 896, 4864),
    ("mlp.up_proj", 896, 4864),
    ("mlp.down_proj", 4864, 896),
)
LAYERS = 24


def adapter_shapes(rank: int) -> list[tuple[str, tuple[int, ...]]]:
    """The adapter tensors of r=`rank` LoRA on every linear layer, as the injected model names
    them (`model.layers.0.self_attn.q_proj.lora_A.default.weight`: A is [r, in], B [out, r])."""
    out = []
    for i in range(LAYERS):
        for module, fan_in, fan_out in LINEARS:
            stem = f"model.layers.{i}.{module}"
            out += [
                (f"{stem}.lora_A.default.weight", (rank, fan_in)),
                (f"{stem}.lora_B.default.weight", (fan_out, rank)),
            ]
    return out


@functools.cache
def random_tensors(kind: str, rank: int) -> dict[str, torch.Tensor]:
    """Random bf16 tensors of the full model or its adapters (made once: every version sends
    the same bytes, which costs the transport the same as new ones)."""
    shapes = qwen05b_shapes(1.0) if kind == "full" else adapter_shapes(rank)
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes}


def nbytes(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(torch.Size(s).numel() * 2 for _, s in shapes)


# ---------------------------------------------------------------- the engine process


def _engine(kind: str, address: str, name: str, rank: str) -> None:
    from kuberl.common.weights import EngineClient

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if kind == "lora_sglang":
        load, close = _sglang_loader(int(rank))
    else:
        load, close = _torch_loader(kind, int(rank)), lambda: None
    client = EngineClient(address, load=load, engine_id=name, shm_in_place=True)
    client.start()
    stop.wait()
    client.stop()
    close()


def _torch_loader(kind: str, rank: int) -> Any:
    """The torch engine's load into parameters of the version's shapes (touched memory)."""
    from kuberl.rollout.engine.torch_engine import load_state

    shapes = qwen05b_shapes(1.0) if kind == "full" else adapter_shapes(rank)
    params = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes}
    borrowed = [False]

    def load(tensors: dict[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            borrowed[0] = load_state(
                params, list(tensors.items()), borrow=True, borrowed=borrowed[0]
            )

    return load


def _sglang_loader(rank: int) -> Any:
    """An SGLang replica's adapter load: `SGLangEngine.load_adapter` on its own event loop, as
    the rollout service runs it, against the SGLang API stand-in (not SGLang)."""
    from kuberl.common.config import LoraConfig, SGLangEngineConfig
    from kuberl.rollout.engine.sglang import SGLangEngine
    from tests.integration.sglang_standin import SGLangStandIn

    lora = LoraConfig(rank=rank)
    server = SGLangStandIn(lora_max_rank=rank, lora_target_modules=tuple(lora.target_modules))
    server.start()
    folder = tempfile.mkdtemp(prefix="kuberl-lora-bench-")
    engine = SGLangEngine(
        SGLangEngineConfig(url=server.url, snapshot_dir=folder), model_path=None, lora=lora
    )
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def load(tensors: dict[str, torch.Tensor], version: int) -> None:
        asyncio.run_coroutine_threadsafe(engine.load_adapter(tensors, version), loop).result()

    def close() -> None:
        asyncio.run_coroutine_threadsafe(engine.close(), loop).result()
        server.stop()

    return load, close


# ---------------------------------------------------------------- the run


def measure(kind: str, transport: str, rank: int, repeat: int) -> dict[str, float]:
    tensors = random_tensors("full" if kind == "full" else "lora", rank)
    result = relay_run(
        1.0,
        transport,
        1,
        repeat,
        make=lambda version: tensors,
        engine_command=lambda address, i: [
            sys.executable,
            __file__,
            "--engine",
            kind,
            address,
            f"e{i}",
            str(rank),
        ],
    )
    result["mb_per_second"] = result["bytes"] / result["seconds"] / 1e6
    print(f"{kind} over {transport}: {result}", file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--transports", nargs="+", default=["shm", "snapshot"])
    parser.add_argument("--repeat", type=int, default=3, help="timed versions per setting (best)")
    parser.add_argument("--engine", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        return _engine(*args.engine)

    import json

    full_bytes = nbytes(qwen05b_shapes(1.0))
    lora_bytes = nbytes(adapter_shapes(args.rank))
    load_before = os.getloadavg()
    runs: dict[str, dict[str, Any]] = {}
    for transport in args.transports:
        by_kind = {
            kind: measure(kind, transport, args.rank, args.repeat)
            for kind in ("full", "lora_torch", "lora_sglang")
        }
        full_s = by_kind["full"]["seconds"]
        runs[transport] = {
            **by_kind,
            "seconds_ratio_lora_torch_over_full": by_kind["lora_torch"]["seconds"] / full_s,
            "seconds_ratio_lora_sglang_over_full": by_kind["lora_sglang"]["seconds"] / full_s,
        }
    ratio = lora_bytes / full_bytes
    result = {
        "benchmark": "lora_sync",
        "machine": f"{platform.node()} {os.cpu_count()} CPU cores, {platform.machine()}, "
        f"torch {torch.__version__}",
        "load_average_1_5_15": {"start": load_before, "end": os.getloadavg()},
        "model": "Qwen2-0.5B shapes, bf16, random values",
        "lora": {"rank": args.rank, "target_modules": [m.rsplit(".", 1)[1] for m, _, _ in LINEARS]},
        "full_bytes": full_bytes,
        "lora_bytes": lora_bytes,
        "bytes_ratio_lora_over_full": ratio,
        "engines": 1,
        "transports": runs,
        "lora_sglang_engine": "SGLangEngine.load_adapter against the SGLang API stand-in "
        "(tests/integration/sglang_standin.py), not SGLang",
        "goal": "a LoRA update moves <= 5% of the full model's bytes",
        "goal_met": ratio <= 0.05,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
