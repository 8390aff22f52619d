"""A trainer engine resuming from a DeepSpeed checkpoint whose shard was replaced by a pickle that
runs code when loaded. Run as `python -m tests.security.tampered_checkpoint FOLDER STAGE`: it
saves a real checkpoint with `kuberl.trainer.engine.TrainEngine` (ZeRO STAGE, gloo world of one),
checks that the untouched checkpoint loads back, swaps one shard for the hostile pickle and loads
again, then prints one JSON line: whether the clean load worked, what the tampered load raised,
and whether the payload ran (it would create FOLDER/pwned).
"""

from __future__ import annotations

import json
import os
import pickle  # this test forges the hostile checkpoint that kuberl must refuse
import shutil
import sys
from pathlib import Path

import torch


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def main(folder: Path, stage: int) -> dict[str, object]:
    from kuberl.common.config import TrainerConfig
    from kuberl.trainer.distributed import init_distributed
    from kuberl.trainer.engine import TrainEngine

    info = init_distributed()
    config = TrainerConfig(zero_stage=stage)  # type: ignore[arg-type]
    engine = TrainEngine(torch.nn.Linear(4, 4), config, info, torch.float32)
    loss = engine.engine(torch.randn(2, 4)).sum()
    engine.backward(loss)
    engine.step()
    engine.save(folder / "ckpt", "step-1")
    shutil.copytree(folder / "ckpt", folder / "clean")
    engine.load(folder / "clean", "step-1")
    clean = True

    marker = folder / "pwned"
    shards = sorted((folder / "ckpt" / "step-1").glob("*.pt"))
    for shard in shards:
        with shard.open("wb") as f:
            pickle.dump({"module": _Payload(str(marker))}, f)
    try:
        engine.load(folder / "ckpt", "step-1")
        error = ""
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"clean_load": clean, "error": error[:400], "payload_ran": marker.exists()}


if __name__ == "__main__":
    result = main(Path(sys.argv[1]), int(sys.argv[2]))
    sys.stdout.write(json.dumps(result) + "\n")
