"""Prompt datasets: JSONL and Parquet with a column mapping, and the per-epoch seeded shuffle."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kuberl.common.datasets import epoch_order, read_dataset
from kuberl.common.errors import InvalidArgument

ROWS = [
    {"question": "1+1?", "solution": 2, "source": "a", "level": 1},
    {"question": "2+3?", "solution": 5, "source": "b", "level": 2},
]


def _jsonl(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_columns_map_to_prompt_answer_and_the_other_columns_as_metadata(
    tmp_path: Path,
) -> None:
    rows = read_dataset(_jsonl(tmp_path, ROWS), prompt="question", answer="solution")
    assert [(r.text, r.answer, json.loads(r.metadata_json)) for r in rows] == [
        ("1+1?", "2", {"source": "a", "level": 1}),
        ("2+3?", "5", {"source": "b", "level": 2}),
    ]


def test_parquet_reads_like_jsonl_with_selected_metadata_and_a_limit(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    rows = read_dataset(path, prompt="question", answer="solution", metadata=["level"], limit=1)
    assert [(r.text, r.answer, r.metadata_json) for r in rows] == [("1+1?", "2", '{"level": 1}')]


def test_a_missing_prompt_column_names_the_row_and_the_columns_there_are(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"row 1: no prompt column 'prompt' \(columns: "):
        read_dataset(_jsonl(tmp_path, ROWS))


def test_a_line_that_is_not_json_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(InvalidArgument, match=r"bad.jsonl:2: not valid JSON"):
        read_dataset(path)


def test_an_unsupported_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("prompt\nx\n")
    with pytest.raises(InvalidArgument, match="use .jsonl or .parquet"):
        read_dataset(path)


def test_each_epoch_is_a_permutation_of_all_prompts() -> None:
    ids = [f"d:{i}" for i in range(50)]
    assert [sorted(epoch_order(ids, 3, e)) for e in range(3)] == [sorted(ids)] * 3


def test_the_order_is_reproducible_and_differs_between_epochs_and_seeds() -> None:
    ids = [f"d:{i}" for i in range(50)]
    order = epoch_order(ids, 3, 1)
    same = order == epoch_order(list(reversed(ids)), 3, 1)
    assert (same, order != epoch_order(ids, 3, 0), order != epoch_order(ids, 4, 1)) == (
        True,
        True,
        True,
    )


def test_parquet_dates_decimals_and_bytes_become_json_metadata(tmp_path: Path) -> None:
    # json.dumps refused datetime, Decimal and bytes cells: the buffer did not start, and the
    # message named no row or column.
    import datetime
    import decimal

    path = tmp_path / "typed.parquet"
    table = pa.table(
        {
            "prompt": ["q"],
            "ts": pa.array([datetime.datetime(2026, 11, 26, 23, 59)], pa.timestamp("s")),
            "day": pa.array([datetime.date(2026, 11, 26)]),
            "price": pa.array([decimal.Decimal("12.50")], pa.decimal128(5, 2)),
            "blob": pa.array([b"\x00\xff"], pa.binary()),
        }
    )
    pq.write_table(table, path)
    (row,) = read_dataset(path)
    assert json.loads(row.metadata_json) == {
        "ts": "2026-11-26T23:59:00",
        "day": "2026-11-26",
        "price": "12.50",
        "blob": "AP8=",
    }


def test_text_that_is_not_valid_unicode_names_its_row(tmp_path: Path) -> None:
    # A lone surrogate in JSONL parses, then failed the Redis write with UnicodeEncodeError.
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": "broken \\ud83d here"}\n')
    with pytest.raises(InvalidArgument, match="row 2: text that is not valid Unicode"):
        read_dataset(path)
