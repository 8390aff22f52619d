"""Prompt datasets: `read_dataset` reads a JSONL or Parquet file, a folder saved by `datasets`
(`save_to_disk`), a folder of data files, or a hub dataset id (fetched once by
`kuberl.common.hub`, then read by `datasets` from the cached snapshot, split and subset picked)
through a column mapping into `PromptRow`s for the buffer's LoadDataset and for
`kuberl.common.modelbuild`'s tokenizer corpus (`read_records` reads a file's raw records, as the
trainer's SFT data does); `epoch_order` is an epoch's seeded permutation, so
a restarted job replays its data in order.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kuberl.common.errors import InvalidArgument


@dataclass(frozen=True)
class PromptRow:
    """One prompt of a dataset as stored in Redis (`payload` is what LeasePrompts hands out)."""

    text: str
    answer: str
    metadata_json: str

    def payload(self) -> str:
        return json.dumps(
            {"t": self.text, "a": self.answer, "m": self.metadata_json}, ensure_ascii=False
        )


def _jsonable(value: Any) -> Any:
    """Parquet cells (numpy scalars, arrays, NaN, dates, decimals, bytes) as plain JSON values:
    dates and times as ISO 8601 text, decimals as their exact text, bytes as base64."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, np.ndarray):
        return [_jsonable(v) for v in value.tolist()]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


#: Files read without the `datasets` library.
FILE_SUFFIXES = (".jsonl", ".ndjson", ".parquet")


def is_saved_dataset(folder: Path) -> bool:
    """A folder written by `datasets`' `save_to_disk` (one Dataset or a DatasetDict)."""
    return (folder / "state.json").exists() or (folder / "dataset_dict.json").exists()


def _folder_records(
    folder: Path, subset: str | None, split: str, limit: int
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Rows of a `save_to_disk` folder, or of a folder of data files (a hub snapshot) read by
    `datasets.load_dataset`, which caches what it converts under HF_HOME."""
    import datasets

    try:
        if is_saved_dataset(folder):
            loaded = datasets.load_from_disk(str(folder))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ValueError(f"no split {split!r}; it has {', '.join(loaded)}")
                loaded = loaded[split]
        else:
            loaded = datasets.load_dataset(str(folder), subset, split=split)
    except (ValueError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise InvalidArgument(f"dataset {folder}: {exc}") from None
    if not isinstance(loaded, datasets.Dataset):
        raise InvalidArgument(f"dataset {folder}: split {split!r} is not one table")
    if limit:
        loaded = loaded.select(range(min(limit, len(loaded))))
    for i, record in enumerate(loaded):
        yield i + 1, dict(record)


def read_records(path: Path, limit: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line or row number, record) of a JSONL or Parquet file, the first `limit` (0: all).
    InvalidArgument names the file and line of a record that is not a JSON object; OSError when
    the file cannot be read."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        with path.open(encoding="utf-8") as f:
            n = 0
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InvalidArgument(f"{path}:{lineno}: not valid JSON: {exc.msg}") from None
                if not isinstance(record, dict):
                    raise InvalidArgument(f"{path}:{lineno}: expected a JSON object per line")
                yield lineno, record
                n += 1
                if limit and n >= limit:
                    return
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if limit:
            table = table.slice(0, limit)
        for i, record in enumerate(table.to_pylist()):
            yield i + 1, record
    else:
        raise InvalidArgument(
            f"{path}: unsupported dataset format {suffix!r}; use .jsonl or .parquet"
        )


def read_dataset(
    path: str | Path,
    *,
    prompt: str = "prompt",
    answer: str = "answer",
    metadata: Sequence[str] = (),
    limit: int = 0,
    split: str = "train",
    subset: str | None = None,
    revision: str | None = None,
) -> list[PromptRow]:
    """Rows of a dataset (see the module docstring): `prompt` column as text, `answer` as the
    reference answer (numbers are turned into text, a missing answer is ""), `metadata` columns
    (empty: every other column) as a JSON object. `split`, `subset` and `revision` choose what a
    folder or hub id holds. InvalidArgument names the file, row and column on any problem."""
    from kuberl.common import hub

    p = Path(path)
    if not p.exists() and hub.is_hub_id(str(path)):
        try:
            p = hub.fetch_dataset(str(path), revision)
        except ValueError as exc:  # ConfigError: its message names the id and the fix
            raise InvalidArgument(str(exc)) from None
    if p.is_dir():
        records = _folder_records(p, subset, split, limit)
    elif p.is_file():
        records = read_records(p, limit)
    else:
        raise InvalidArgument(f"dataset {p}: no such file (relative paths are from {Path.cwd()})")
    rows: list[PromptRow] = []
    for row_no, record in records:
        if prompt not in record:
            raise InvalidArgument(
                f"{p} row {row_no}: no prompt column {prompt!r} (columns: {', '.join(record)})"
            )
        text = record[prompt]
        if not isinstance(text, str) or not text:
            raise InvalidArgument(
                f"{p} row {row_no}: prompt column {prompt!r} must be non-empty text, "
                f"got {type(text).__name__}"
            )
        ref = record.get(answer)
        ref_text = (
            "" if ref is None else ref if isinstance(ref, str) else json.dumps(_jsonable(ref))
        )
        if metadata:
            missing = [c for c in metadata if c not in record]
            if missing:
                raise InvalidArgument(
                    f"{p} row {row_no}: metadata columns {missing} not found "
                    f"(columns: {', '.join(record)})"
                )
            meta = {c: _jsonable(record[c]) for c in metadata}
        else:
            meta = {k: _jsonable(v) for k, v in record.items() if k not in (prompt, answer)}
        row = PromptRow(text, ref_text, json.dumps(meta, ensure_ascii=False) if meta else "")
        try:
            row.payload().encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate ("\ud83d"): Redis would refuse it
            raise InvalidArgument(
                f"{p} row {row_no}: text that is not valid Unicode ({exc.reason} at "
                f"{exc.object[exc.start : exc.end]!r})"
            ) from None
        rows.append(row)
    if not rows:
        raise InvalidArgument(f"dataset {p}: no rows")
    return rows


#: The buffer's prompt streams' index mixed into the shuffle seed, so train and eval orders
#: differ for one seed.
SHUFFLE_STREAM = {"train": 0, "eval": 1}


def epoch_sets_order(
    sets: Sequence[tuple[str, int]], seed: int, epoch: int, stream: int = 0
) -> list[str]:
    """`epoch_order` of the prompts of datasets (name, number of prompts): ids `<name>:<row>`,
    the buffer's prompt ids, in the order the buffer queues that epoch."""
    return epoch_order([f"{n}:{i}" for n, count in sets for i in range(count)], seed, epoch, stream)


def epoch_order(prompt_ids: Sequence[str], seed: int, epoch: int, stream: int = 0) -> list[str]:
    """The prompt ids of one epoch in their seeded order: a permutation of the sorted ids,
    determined by (seed, stream, epoch) alone."""
    ids = sorted(prompt_ids)
    rng = np.random.default_rng([seed & 0xFFFFFFFF, stream, epoch])
    return [ids[i] for i in rng.permutation(len(ids))]
