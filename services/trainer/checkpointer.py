"""When and how the trainer writes and reads its checkpoints (the files: `checkpoint`).

Every rank saves its DeepSpeed shards into a folder rank 0 names; rank 0 adds the cursor and the
export (`hf/`; with LoRA `adapter/` and optionally `merged/`) and then commits the folder as
`latest`. `saved_at` is the (sft step, step) position of
the weights the newest checkpoint holds: steps trained past it are "unsaved", and their batches
are held in the buffer until a checkpoint has them.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from kuberl.common import lora
from kuberl.common import metrics as prom
from kuberl.common.config import JobConfig
from kuberl.common.logs import get_logger
from kuberl.trainer import checkpoint as ckpt
from kuberl.trainer.distributed import DistInfo, barrier, broadcast_bytes
from kuberl.trainer.models import Models

log = get_logger(__name__)

CHECKPOINT_SECONDS = prom.histogram("kuberl_trainer_checkpoint_seconds", "Checkpoint wall time")
# Bucket size of the parameters gathered for the HF export.
EXPORT_BUCKET_BYTES = 64 * 1024 * 1024


def position(cursor: ckpt.Cursor) -> tuple[int, int]:
    """Where training is: (SFT warm-up steps, RL or SFT steps)."""
    return cursor.sft_step, cursor.step


class Checkpointer:
    """Saves and loads the models and the cursor under `trainer.checkpoint_dir`."""

    def __init__(self, config: JobConfig, dist: DistInfo, models: Models, base_dir: Path) -> None:
        self.tc = config.trainer
        self.lora = config.model.lora
        self.dist = dist
        self.models = models
        root = Path(self.tc.checkpoint_dir)
        self.root = root if root.is_absolute() else base_dir / root
        #: The position of the weights in the last checkpoint written or loaded.
        self.saved_at: tuple[int, int] | None = None

    def unsaved(self, cursor: ckpt.Cursor) -> bool:
        """Steps were trained since the last checkpoint (or, with none, at all)."""
        return self.saved_at != position(cursor) and any(position(cursor))

    def holds(self, cursor: ckpt.Cursor) -> bool:
        """The newest checkpoint holds the current weights."""
        return self.saved_at == position(cursor)

    def load_latest(self) -> tuple[Path, ckpt.Cursor] | None:
        """Load the newest checkpoint, when `trainer.resume` and there is one. Collective."""
        path = ckpt.latest(self.root) if self.tc.resume else None
        if path is None:
            return None
        if self.tc.mode != "eval":  # eval mode needs only the cursor: engines hold weights
            self.models.engine.load(path / "policy", path.name)
            if self.models.critic is not None:
                self.models.critic.load(path / "critic", path.name)
        cursor = ckpt.read_cursor(path, self.dist.rank)
        self.saved_at = position(cursor)
        return path, cursor

    def _export(self, path: Path) -> None:
        """The policy for use outside kuberl: `hf/`, or with LoRA `adapter/` (PEFT's format)
        and, with `model.lora.export_merged`, `merged/` (the base with the adapters merged in,
        an ordinary HF folder). Collective: every rank gathers."""
        adapters = self.lora
        select = None if adapters is None or adapters.export_merged else lora.is_adapter_tensor
        named: list[tuple[str, torch.Tensor]] = []
        for bucket in self.models.engine.full_parameters(EXPORT_BUCKET_BYTES, "hf.", select):
            named.extend(bucket)
        if not self.dist.is_main:
            return
        model_dir, tied = self.models.model_dir, self.models.tied
        if adapters is None:
            ckpt.export_hf(named, model_dir, path / "hf", tied)
            return
        lora.save_adapter(
            path / ckpt.ADAPTER_EXPORT, lora.adapter_tensors(named), adapters, str(model_dir)
        )
        if adapters.export_merged:
            ckpt.export_hf(lora.merged(named, adapters), model_dir, path / ckpt.MERGED_EXPORT, tied)

    def save(self, cursor: ckpt.Cursor, metrics: dict[str, float]) -> Path:
        """Save engines, cursor (with the finite `metrics`), RNG and an HF export, and commit
        the folder as `latest`. Collective."""
        engine = self.models.engine
        started = time.perf_counter()
        # Rank 0 names it (never a complete checkpoint's folder) and every rank writes there.
        tag = ckpt.fresh_tag(self.root, cursor.step) if self.dist.is_main else None
        tag = broadcast_bytes(tag.encode() if tag else None, self.dist).decode()
        path = self.root / tag
        if self.dist.is_main:
            path.mkdir(parents=True, exist_ok=True)
        barrier(self.dist)
        engine.save(path / "policy", tag)
        if self.models.critic is not None:
            self.models.critic.save(path / "critic", tag)
        ckpt.write_rank_files(path, self.dist.rank)
        if self.tc.export_hf:
            self._export(path)
        if self.dist.is_main:
            cursor.metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
            ckpt.write_cursor(path, cursor)
        ckpt.sync_tree(path)  # on disk before `latest` names it
        barrier(self.dist)
        if self.dist.is_main:
            ckpt.commit(self.root, path, self.tc.keep_checkpoints)
        barrier(self.dist)
        CHECKPOINT_SECONDS.observe(time.perf_counter() - started)
        self.saved_at = position(cursor)
        log.info(
            "checkpoint.saved", path=str(path), seconds=round(time.perf_counter() - started, 2)
        )
        return path
