"""Models and datasets by Hugging Face id, against a stand-in for the hub (tests/hub_standin.py:
the routes huggingface_hub's snapshot_download calls, served from local folders), since the real
hub cannot be reached from here. Each resolve runs in a fresh process with HF_ENDPOINT pointing
at the stand-in, so nothing can reach the internet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kuberl.common import hub
from kuberl.common.config import ConfigError
from kuberl.common.datasets import read_dataset
from kuberl.common.modelbuild import build_model
from tests.hub_standin import HubStandIn, hub_standin

MODEL = "standin/tiny-qwen"
DATASET = "standin/arith"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def standin(model_folder: Path, tmp_path: Path) -> Iterator[HubStandIn]:
    data = tmp_path / "dataset-repo"
    (data / "data").mkdir(parents=True)
    for split, rows in (("train", [("1+1", "2"), ("2+2", "4")]), ("test", [("3+4", "7")])):
        lines = [json.dumps({"question": q, "solution": a}) for q, a in rows]
        (data / "data" / f"{split}-00000-of-00001.jsonl").write_text("\n".join(lines) + "\n")
    with hub_standin() as h:
        h.add("model", MODEL, model_folder)
        h.add("dataset", DATASET, data)
        yield h


def _python(code: str, tmp: Path, endpoint: str, **env: str) -> subprocess.CompletedProcess[str]:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    full = {**inherited, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp / "hf"), **env}
    return subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120
    )


RESOLVE = "from kuberl.common.hub import resolve_model as r; print(r({!r}, {!r}))"


def test_a_hub_model_is_fetched_once_then_used_from_the_cache(
    standin: HubStandIn, tmp_path: Path, model_folder: Path
) -> None:
    first = _python(RESOLVE.format(MODEL, None), tmp_path, standin.url)
    assert first.returncode == 0, first.stderr
    folder = Path(first.stdout.strip())
    assert (folder / "config.json").read_bytes() == (model_folder / "config.json").read_bytes()
    assert str(folder).startswith(str(tmp_path / "hf"))
    fetched = len(standin.downloads())
    assert fetched == len(list(model_folder.iterdir()))
    offline = _python(RESOLVE.format(MODEL, None), tmp_path, standin.url, HF_HUB_OFFLINE="1")
    assert (offline.stdout.strip(), len(standin.downloads())) == (str(folder), fetched)


def test_offline_a_model_not_in_the_cache_names_the_field_and_the_command(
    standin: HubStandIn, tmp_path: Path
) -> None:
    result = _python(RESOLVE.format(MODEL, "v1"), tmp_path, standin.url, HF_HUB_OFFLINE="1")
    assert "model.path: standin/tiny-qwen (revision v1) is not in the Hugging Face cache" in (
        result.stderr
    )
    assert "`hf download standin/tiny-qwen --revision v1`" in result.stderr
    assert standin.requests == []


def test_a_revision_the_hub_lacks_is_named(standin: HubStandIn, tmp_path: Path) -> None:
    result = _python(RESOLVE.format(MODEL, "v9"), tmp_path, standin.url)
    assert "standin/tiny-qwen (revision v9) has no such revision on the hub" in result.stderr


def test_an_unknown_id_says_it_is_neither_local_nor_on_the_hub(
    standin: HubStandIn, tmp_path: Path
) -> None:
    result = _python(RESOLVE.format("standin/none", None), tmp_path, standin.url)
    assert "standin/none is no local path and no model on the hub" in result.stderr


def test_a_local_model_folder_is_used_as_is(model_folder: Path) -> None:
    assert hub.resolve_model(str(model_folder)) == model_folder


def test_a_local_path_is_never_taken_for_an_id(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.path: .*/missing does not exist"):
        hub.resolve_model("./missing", base=tmp_path)
    assert not hub.is_hub_id("data/train.jsonl")
    assert hub.is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")


def test_a_hub_dataset_is_read_by_split_through_the_column_mapping(
    standin: HubStandIn, tmp_path: Path
) -> None:
    code = (
        "from kuberl.common.datasets import read_dataset as r; "
        f"print([(x.text, x.answer) for x in r({DATASET!r}, prompt='question', "
        "answer='solution', split='test')])"
    )
    result = _python(code, tmp_path, standin.url)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[('3+4', '7')]"


def test_a_saved_dataset_folder_is_read_by_split(tmp_path: Path) -> None:
    import datasets

    splits = {
        "train": datasets.Dataset.from_dict({"question": ["1+1"], "answer": [2]}),
        "test": datasets.Dataset.from_dict({"question": ["5+5"], "answer": [10]}),
    }
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))
    rows = read_dataset(tmp_path / "saved", prompt="question", split="test")
    assert [(r.text, r.answer) for r in rows] == [("5+5", "10")]


def test_a_split_the_saved_dataset_lacks_lists_the_splits(tmp_path: Path) -> None:
    import datasets

    from kuberl.common.errors import InvalidArgument

    splits = {"train": datasets.Dataset.from_dict({"prompt": ["1+1"]})}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(InvalidArgument, match="no split 'validation'; it has train"):
        read_dataset(tmp_path / "saved", split="validation")


def test_kuberl_serve_hands_its_service_a_fetched_folder(
    standin: HubStandIn, tmp_path: Path
) -> None:
    code = (
        "from kuberl.common.config import parse_job_config as p; "
        "from kuberl.common.preflight import with_local_models as w; "
        f"c = p({{'model': {{'path': {MODEL!r}}}}}, env={{}}); "
        "print(w(c, 'trainer').model.path); print(w(c, 'buffer').model.path)"
    )
    result = _python(code, tmp_path, standin.url)
    trainer, buffer = result.stdout.strip().splitlines()[-2:]
    assert (Path(trainer) / "config.json").exists(), result.stderr
    assert buffer == MODEL  # a service that loads no model fetches nothing
