"""Locally built models: real HF folders, exact tokenizers, deterministic and cached builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kuberl.common.config import ConfigError, parse_job_config
from kuberl.common.modelbuild import build_model, build_tokenizer, load_tokenizer, resolve_model
from tests.support import GSM8K_TRAIN as GSM8K


def test_the_digit_tokenizer_round_trips_text_one_token_per_character() -> None:
    tok = build_tokenizer("digits")
    text = "Q: 12+34=?\nA: 46 apples"
    ids = tok(text).input_ids
    assert (len(ids), tok.decode(ids)) == (len(text), text)


def test_the_bpe_tokenizer_is_trained_on_the_corpus_and_round_trips() -> None:
    tok = build_tokenizer("bpe", ["natalia sold clips to her friends"] * 50, vocab_size=400)
    ids = tok("natalia sold clips").input_ids
    assert tok.decode(ids) == "natalia sold clips" and len(ids) < len("natalia sold clips")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_built_model_loads_with_plain_transformers_and_generates(
    tmp_path: Path, arch: str
) -> None:
    path = build_model(tmp_path / arch, arch=arch, size="tiny", tokenizer="digits", seed=3)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    out = model.generate(**tok("1+1=", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert (model.config.model_type, out.shape[1]) == (arch, 8)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_built_folder_loads_the_tokenizer_it_was_built_with(tmp_path: Path, arch: str) -> None:
    # transformers 5's AutoTokenizer gives a qwen2 folder a Qwen2Tokenizer that drops whitespace.
    path = build_model(tmp_path / arch, arch=arch, size="tiny", tokenizer="digits", seed=3)
    text = "What is 12 plus 7?\n A: 19"
    assert load_tokenizer(path)(text).input_ids == build_tokenizer("digits")(text).input_ids


def test_the_same_seed_builds_the_same_weights(tmp_path: Path) -> None:
    a = AutoModelForCausalLM.from_pretrained(build_model(tmp_path / "a", seed=7))
    b = AutoModelForCausalLM.from_pretrained(build_model(tmp_path / "b", seed=7))
    assert all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_resolve_builds_once_into_the_cache_and_reuses_it(tmp_path: Path) -> None:
    config = parse_job_config(
        {
            "model": {"build": {"tokenizer": "bpe"}},
            "data": {
                "train": [{"path": str(GSM8K), "columns": {"prompt": "question"}, "limit": 200}]
            },
        },
        env={},
    )
    first = resolve_model(config, cache_dir=tmp_path / "cache")
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    second = resolve_model(config, cache_dir=tmp_path / "cache")
    assert (second, (second / "model.safetensors").stat().st_mtime_ns) == (first, mtime)


def test_a_model_path_without_a_config_is_refused(tmp_path: Path) -> None:
    config = parse_job_config({"model": {"path": str(tmp_path)}}, env={})
    with pytest.raises(ConfigError, match="model.path: .* has no config.json"):
        resolve_model(config)


def test_the_bpe_corpus_is_read_as_the_buffer_reads_datasets(tmp_path: Path) -> None:
    # JSONL with a blank line (JSONDecodeError) and Parquet (UnicodeDecodeError) once failed.
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kuberl.common.config import DatasetConfig
    from kuberl.common.modelbuild import _dataset_texts

    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"q": "one", "answer": "1"}\n\n{"q": "two", "answer": 2}\n')
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"q": ["three", "four"], "answer": ["3", "4"]}), parquet)
    texts = [
        _dataset_texts(DatasetConfig(path=str(p), columns={"prompt": "q"}, limit=n), tmp_path)
        for p, n in ((jsonl, 0), (parquet, 1))
    ]
    assert texts == [["one\n1", "two\n2"], ["three\n3"]]
