"""Read experiment-tracker output back from disk, without any network: TensorBoard event files
(tensorboard's EventAccumulator), W&B offline runs (the `.wandb` transaction log, parsed here:
wandb 0.31 ships no Python reader) and MLflow stores (MlflowClient)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_WANDB_HEADER = struct.Struct("<4sHB")  # b":W&B", magic 0xBEE1, version 0
_RECORD_HEADER = struct.Struct("<IHB")  # crc32c, length, type (leveldb log format)
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list[Any]:
    """Every `wandb_internal_pb2.Record` of a `.wandb` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = _WANDB_HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path} is not a .wandb log"
    pos, pending, out = _WANDB_HEADER.size, b"", []
    while pos + _RECORD_HEADER.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _RECORD_HEADER.size:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = _RECORD_HEADER.unpack_from(data, pos)
        if kind == 0:
            break
        chunk = data[pos + _RECORD_HEADER.size : pos + _RECORD_HEADER.size + length]
        pos += _RECORD_HEADER.size + length
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


@dataclass
class WandbRun:
    """What an offline W&B run (one or more `offline-run-*` folders of one id) logged."""

    run_id: str
    #: One dict per history record; a nested key (a table's fields) is joined with "/".
    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    folders: list[Path] = field(default_factory=list)

    def rows_with_table(self, key: str) -> list[dict[str, Any]]:
        """History rows that logged a table under `key` (its fields are `<key>/path`, ...)."""
        return [r for r in self.history if r.get(f"{key}/_type") == "table-file"]

    def table(self, row: dict[str, Any], key: str) -> dict[str, Any]:
        """The table a history row's `key` points at (`files/media/table/...`)."""
        for folder in self.folders:
            path = folder / "files" / row[f"{key}/path"]
            if path.exists():
                return dict(json.loads(path.read_text()))
        raise AssertionError(f"table {row[f'{key}/path']} not found in {self.folders}")


def wandb_runs(wandb_dir: Path) -> dict[str, WandbRun]:
    """The offline runs under `<dir>/wandb/`, by run id, their folders in order of creation."""
    runs: dict[str, WandbRun] = {}
    for folder in sorted((wandb_dir / "wandb").glob("offline-run-*")):
        for log_file in folder.glob("run-*.wandb"):
            for rec in wandb_records(log_file):
                which = rec.WhichOneof("record_type")
                if which == "run":
                    run = runs.setdefault(rec.run.run_id, WandbRun(rec.run.run_id))
                    run.folders.append(folder)
                elif which == "history":
                    run.history.append(
                        {
                            (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                            for i in rec.history.item
                        }
                    )
                elif which == "config":
                    for item in rec.config.update:
                        run.config[item.key or "/".join(item.nested_key)] = json.loads(
                            item.value_json
                        )
    return runs


def tensorboard_runs(logdir: Path) -> dict[str, Any]:
    """An EventAccumulator, reloaded, per run folder under `logdir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for folder in sorted(p for p in logdir.iterdir() if p.is_dir()):
        acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        out[folder.name] = acc
    return out


def tensorboard_scalars(acc: Any, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def tensorboard_texts(acc: Any, tag: str) -> list[tuple[int, str]]:
    """Text summaries (`add_text`) of a tag: (step, markdown)."""
    from tensorboard.util import tensor_util

    out = []
    for e in acc.Tensors(f"{tag}/text_summary"):
        value = tensor_util.make_ndarray(e.tensor_proto)
        out.append((e.step, value.item().decode() if value.shape == () else value[0].decode()))
    return out


#: Environment under which no tracker can reach a network: W&B offline and pointed at a closed
#: local port, every HTTP client behind a proxy that refuses (a reach-out fails, not leaks).
OFFLINE_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_BASE_URL": "http://127.0.0.1:9",
    "WANDB_DISABLE_GIT": "true",
    "WANDB_DISABLE_CODE": "true",
    "WANDB_API_KEY": "",
    "HTTP_PROXY": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "http_proxy": "http://127.0.0.1:9",
    "https_proxy": "http://127.0.0.1:9",
    # Loopback only: the services' own gRPC (which honours the proxy variables) stays direct.
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
    "MLFLOW_ALLOW_FILE_STORE": "true",
}
