"""`kuberl run` and `kuberl config check --files` refuse a job that names something missing before
anything starts: one line per problem naming the field and the fix, no traceback, no run folder.
Every process here is the real CLI; nothing reaches a network (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import REPO


def _job(tmp: Path, **changes: object) -> Path:
    doc = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    doc["job"]["run_dir"] = str(tmp / "runs")
    for section in ("train", "eval"):
        for ds in doc["data"][section]:
            ds["path"] = str(REPO / ds["path"])
    doc["trainer"]["sft_data"] = str(REPO / doc["trainer"]["sft_data"])
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _kuberl(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf")}
    return subprocess.run(
        [sys.executable, "-m", "kuberl.cli", *args],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


BROKEN = [
    "model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "data.train[0].path=openai/gsm8k",
    "data.eval[0].path=missing.jsonl",
    "buffer.filters=[no_such_module:keep]",
]


@pytest.mark.parametrize("command", [["run"], ["config", "check", "--files"]])
def test_every_missing_thing_is_one_line_naming_its_field(
    tmp_path: Path, command: list[str]
) -> None:
    job = _job(tmp_path)
    result = _kuberl(tmp_path, *command, str(job), *BROKEN)
    assert result.returncode != 0
    err = result.stderr
    assert "Traceback" not in err
    assert "model.path: Qwen/Qwen2.5-0.5B-Instruct is not in the Hugging Face cache" in err
    assert "`hf download Qwen/Qwen2.5-0.5B-Instruct`" in err
    assert "data.train[0].path: openai/gsm8k" in err
    assert "`hf download openai/gsm8k --repo-type dataset`" in err
    assert f"data.eval[0].path: {tmp_path / 'missing.jsonl'} does not exist" in err
    assert "buffer.filters[0] 'no_such_module:keep': module 'no_such_module' not found" in err


def test_a_refused_run_leaves_no_run_folder(tmp_path: Path) -> None:
    job = _job(tmp_path)
    result = _kuberl(tmp_path, "run", str(job), "data.eval[0].path=missing.jsonl")
    assert result.returncode == 1, result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_file_of_another_format_is_a_config_error_naming_the_field(tmp_path: Path) -> None:
    result = _kuberl(tmp_path, "config", "check", str(_job(tmp_path)), "data.eval.0.path=q.csv")
    assert result.returncode == 2
    assert "data.eval.0.path: Value error, q.csv: unsupported dataset format" in result.stderr


def test_config_check_files_accepts_the_demo(tmp_path: Path) -> None:
    result = _kuberl(tmp_path, "config", "check", "--files", str(_job(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert "ok (files, models, datasets, plugins)" in result.stdout


def test_buffer_stats_with_nothing_listening_says_how_to_point_it_at_a_run(
    tmp_path: Path,
) -> None:
    result = _kuberl(tmp_path, "buffer", "stats", "--address", "127.0.0.1:9", "--timeout", "2")
    assert result.returncode == 1
    assert "kuberl buffer stats --config runs/<run>/job.yaml" in result.stderr


def test_a_plugin_of_the_wrong_call_is_refused_before_the_start(tmp_path: Path) -> None:
    job = _job(tmp_path)
    spec = "tests.unit.reward_plugins:exact_match"  # takes (sample); as a filter: (group)
    result = _kuberl(tmp_path, "config", "check", "--files", str(job), f"buffer.filters=[{spec}]")
    assert result.returncode == 2
    assert f"buffer.filters[0] '{spec}'" in result.stderr


@pytest.mark.parametrize("kind", ["dict", "JobConfig"])
def test_kuberl_run_from_python_raises_one_config_error_and_makes_no_folder(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kuberl
    from kuberl.common.config import ConfigError, parse_job_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    doc = yaml.safe_load(_job(tmp_path).read_text())
    job = doc if kind == "dict" else parse_job_config(doc, env={})
    with pytest.raises(ConfigError, match=r"data.eval\[0\].path: .*missing.jsonl does not exist"):
        kuberl.run(job, overrides=["data.eval[0].path=missing.jsonl"])
    assert not (tmp_path / "runs").exists()
