"""Checkpoints: DeepSpeed engine state plus the job cursor, written so a crash never leaves a
half checkpoint as "latest".

Layout under `trainer.checkpoint_dir`::

    step-000040/
      policy/step-000040/...     DeepSpeed's own files (model, optimizer, scheduler per rank)
      critic/step-000040/...     the same for the PPO critic, when there is one
      cursor.json                step, policy version, epochs, sft step, eval round, ids of
                                 the batches trained on (rank 0)
      rng-rank<r>.json           torch RNG state of each rank (base64)
      hf/                        HF safetensors export of the policy (rank 0, `export_hf`)
      adapter/                   with `model.lora`, instead of hf/: the adapter in PEFT's format
      merged/                    with `model.lora.export_merged`: the base model with the
                                 adapters merged in, an HF folder like hf/
    latest                       the name of the last complete checkpoint, replaced atomically

Every rank writes its DeepSpeed shards and fsyncs the folder; after a barrier rank 0 replaces
`latest` (fsynced, and its folder). A trainer killed mid-save, or a node lost, resumes from the
previous `latest`. DeepSpeed's files are its own format
(torch.save); everything kuberl adds is JSON or safetensors. With `model.lora` DeepSpeed's files
hold only the trainable parameters (adapters) and their optimizer state, not the frozen base.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kuberl.common.logs import get_logger

log = get_logger(__name__)

LATEST = "latest"
#: The export folders of a LoRA job's checkpoint (a full job's is `hf/`).
ADAPTER_EXPORT = "adapter"
MERGED_EXPORT = "merged"
# Far more than the batches a buffer can have un-acknowledged at once (max_inflight_groups);
# a trainer that acknowledges after its checkpoints keeps at least `checkpoint_every`.
TRAINED_BATCHES_KEPT = 1024
# RL groups (`<prompt>@<epoch>`) of the last trained batches: far more than a second of a job's
# groups, the most a Redis with `appendfsync everysec` can lose on a host crash.
TRAINED_GROUPS_KEPT = 4096


@dataclass
class Cursor:
    """Where the job is: restored on resume."""

    step: int = 0
    policy_version: int = 0
    epoch: int = 0
    sft_step: int = 0
    eval_round: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # Ids of the last batches this checkpoint's weights were trained on (newest last, at most
    # TRAINED_BATCHES_KEPT): a re-delivered batch named here is acknowledged, not trained again.
    trained_batches: list[str] = field(default_factory=list)
    # Keys (`<prompt>@<epoch>`) of the RL groups of the last trained batches (newest last, at
    # most TRAINED_GROUPS_KEPT): a group named here that comes back in another batch (its
    # batch's record lost with the last second of a Redis host's writes) is not trained again.
    trained_groups: list[str] = field(default_factory=list)

    def note_trained(
        self, batch_id: str, group_keys: Sequence[str] = (), keep: int = TRAINED_BATCHES_KEPT
    ) -> None:
        """Note a trained batch; `keep` (at least TRAINED_BATCHES_KEPT) batch ids are kept."""
        if batch_id:
            self.trained_batches.append(batch_id)
            del self.trained_batches[: -max(keep, TRAINED_BATCHES_KEPT)]
        if group_keys:
            self.trained_groups.extend(group_keys)
            del self.trained_groups[:-TRAINED_GROUPS_KEPT]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Cursor:
        data = json.loads(text)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def tag_for(step: int) -> str:
    return f"step-{step:06d}"


def fresh_tag(directory: Path, step: int) -> str:
    """The folder name for a new checkpoint at `step`: `tag_for(step)`, or that name with a
    suffix (`step-000040.1`, ...) when a complete checkpoint already has it.

    A second checkpoint at one step (the SFT warm-up's steps, which leave `step` at 0; a job
    started with `resume: false` in a folder that has that step) must not be written into the
    folder `latest` may name: a crash halfway would leave `latest` pointing at half-written
    files. Names sort by step, then by suffix, so pruning keeps the newest. (A CheckpointNow
    at a step already saved writes nothing: the saved one is its answer.)"""
    base = tag_for(step)
    taken = [p.name for p in directory.glob(f"{base}*") if (p / "cursor.json").exists()]
    taken = [n for n in taken if n == base or n.removeprefix(base + ".").isdigit()]
    if not taken:
        return base
    suffixes = [int(n.removeprefix(base + ".")) for n in taken if n != base]
    return f"{base}.{max(suffixes, default=0) + 1}"


def latest(directory: Path) -> Path | None:
    """The last complete checkpoint folder, or None."""
    pointer = directory / LATEST
    if not pointer.exists():
        return None
    path = directory / pointer.read_text().strip()
    if not (path / "cursor.json").exists():
        raise FileNotFoundError(
            f"{pointer} names {path.name} but {path}/cursor.json is missing; the checkpoint "
            "folder was changed by hand"
        )
    return path


def rng_state() -> dict[str, Any]:
    def text(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode()

    state: dict[str, Any] = {"torch": text(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = text(torch.cuda.get_rng_state())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensor(state["cuda"]))


def write_rank_files(path: Path, rank: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / f"rng-rank{rank}.json").write_text(json.dumps(rng_state()))


def write_cursor(path: Path, cursor: Cursor) -> None:
    tmp = path / "cursor.json.tmp"
    tmp.write_text(cursor.to_json())
    _fsync(tmp)
    os.replace(tmp, path / "cursor.json")
    _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(path: Path) -> None:
    """fsync every file and folder under `path` (and `path` itself): what a rank wrote must be
    on disk before `latest` names it, or a lost node (not only a killed process) could leave
    `latest` naming files that were never written out."""
    for folder, _, files in os.walk(path):
        for name in [*files, ""]:
            # Every rank walks the folder after writing its own files (each is synced by its
            # writer, at least); another rank may rename one of its files away meanwhile.
            with contextlib.suppress(FileNotFoundError):
                _fsync(Path(folder) / name)


def record_eval_round(path: Path, eval_round: int) -> None:
    """Raise the eval round in a checkpoint's cursor (replaced atomically).

    A checkpoint is written before the step's eval round; once that round's groups are read and
    acknowledged, a trainer resumed from the checkpoint must ask for the next round, not wait
    (`eval_timeout_seconds`) for groups that are gone. Nothing else in the cursor changes: the
    round is the buffer's, not the weights'."""
    cursor = Cursor.from_json((path / "cursor.json").read_text())
    if cursor.eval_round < eval_round:
        cursor.eval_round = eval_round
        write_cursor(path, cursor)


def _order(path: Path) -> tuple[str, int]:
    """Sort key of a checkpoint folder: its step's name, then its suffix (`fresh_tag`)."""
    base, _, suffix = path.name.partition(".")
    return base, int(suffix) if suffix.isdigit() else 0


def commit(directory: Path, path: Path, keep: int) -> None:
    """Point `latest` at `path` (atomically), then delete all but the newest `keep`."""
    pointer = directory / LATEST
    previous = directory / pointer.read_text().strip() if pointer.exists() else None
    tmp = directory / f".{LATEST}.tmp"
    tmp.write_text(path.name)
    _fsync(tmp)
    os.replace(tmp, directory / LATEST)
    _fsync(directory)  # the rename itself
    done = sorted((p for p in directory.glob("step-*") if (p / "cursor.json").exists()), key=_order)
    # Kept: this one, and the newest `keep - 1` of the checkpoints up to the previous `latest`
    # (this one may sort below them: a job started with `resume: false` in a folder of later
    # steps). Any other folder was left over by a trainer that died before committing it
    # (after the previous `latest`, or after this one, or a step-N under this step-N.1).
    low = _order(previous) if previous is not None else ("", -1)
    older = [p for p in done if _order(p) <= low and p != path]
    kept = older[len(older) - (keep - 1) :] if keep > 1 else []
    for old in [p for p in done if p not in kept and p != path]:
        shutil.rmtree(old, ignore_errors=True)
    # Folders without a cursor.json were never finished (a trainer killed while saving): the
    # engine shards and optimizer state, the bulk of a save, piled up with each such death.
    # Every rank has finished writing `path` when this runs (after the save's barrier).
    for torn in directory.glob("step-*"):
        if torn != path and torn.is_dir() and not (torn / "cursor.json").exists():
            shutil.rmtree(torn, ignore_errors=True)
    log.info("checkpoint.committed", path=str(path))


def read_cursor(path: Path, rank: int) -> Cursor:
    """The cursor of a checkpoint; restores this rank's RNG state as a side effect."""
    cursor = Cursor.from_json((path / "cursor.json").read_text())
    rng = path / f"rng-rank{rank}.json"
    if rng.exists():
        set_rng_state(json.loads(rng.read_text()))
    return cursor


def export_hf(
    named: list[tuple[str, torch.Tensor]], model_dir: Path, out: Path, tied: bool
) -> Path:
    """An HF folder: the source model's config and tokenizer files plus model.safetensors."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".index.json")):
            shutil.copy2(f, out / f.name)
    tensors = {n: t.contiguous() for n, t in named if not (tied and n == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
