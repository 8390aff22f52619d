"""Prompt datasets: `read_dataset` reads a JSONL or Parquet file through a column mapping into
`PromptRow`s for the buffer's LoadDataset and for `kuberl.common.modelbuild`'s tokenizer corpus;
`epoch_order` is an epoch's seeded permutation, so a restarted job replays its data in order.
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


def _records(path: Path, limit: int) -> Iterator[tuple[int, dict[str, Any]]]:
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
) -> list[PromptRow]:
    """Rows of a .jsonl/.parquet file: `prompt` column as text, `answer` as the reference answer
    (numbers are turned into text, a missing answer is ""), `metadata` columns (empty: every other
    column) as a JSON object. InvalidArgument names the file, row and column on any problem."""
    p = Path(path)
    if not p.is_file():
        raise InvalidArgument(f"dataset {p}: no such file (relative paths are from {Path.cwd()})")
    rows: list[PromptRow] = []
    for row_no, record in _records(p, limit):
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


def epoch_order(prompt_ids: Sequence[str], seed: int, epoch: int, stream: int = 0) -> list[str]:
    """The prompt ids of one epoch in their seeded order: a permutation of the sorted ids,
    determined by (seed, stream, epoch) alone."""
    ids = sorted(prompt_ids)
    rng = np.random.default_rng([seed & 0xFFFFFFFF, stream, epoch])
    return [ids[i] for i in rng.permutation(len(ids))]
