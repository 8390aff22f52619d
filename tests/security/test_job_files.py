"""Job files that cannot work fail at start, naming the field and what would fix it.

Each case is a real `kuberl config check JOB` or `kuberl serve SERVICE --config JOB` process:
it must exit 2 (the CLI's configuration error) before anything starts, and its stderr must
name the field path and say what is expected or what to do. Wrong types, unknown keys (with a
"did you mean"), missing files (model, datasets, TLS certificates; checked by `kuberl serve`
for the files that service reads, since `config check` often runs away from the pods' volumes)
and combinations that can never run. kuberl's trainer picks NCCL only on GPUs and gloo on CPU
by itself, so the issue's "ZeRO-3 with a CPU-only NCCL backend" cannot be written down; its
counterpart that can — GPU-only transports or devices in a CPU-only local run — is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import REPO

LOCAL = {"host": "127.0.0.1", "port": 0, "metrics_port": 0}


def _kuberl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KUBERL_")}
    return subprocess.run(
        [sys.executable, "-m", "kuberl.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**clean, **(env or {})},
        timeout=120,
    )


def _job(tmp_path: Path, doc: Any, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


# (job document, the lines stderr must contain)
CHECK_CASES: dict[str, tuple[Any, list[str]]] = {
    "wrong type": (
        {"trainer": {"zero_stage": "three"}},
        ["trainer.zero_stage: Input should be 0, 1, 2 or 3", "(got 'three')"],
    ),
    "number as text": (
        {"rollout": {"group_size": "eight"}},
        ["rollout.group_size: Input should be a valid integer", "(got 'eight')"],
    ),
    "negative timeout": (
        {"buffer": {"lease_timeout_seconds": -5}},
        ["buffer.lease_timeout_seconds: Input should be greater than 0", "(got -5)"],
    ),
    "unknown key": (
        {"buffer": {"lease_timeout_secs": 30}},
        [
            "buffer.lease_timeout_secs: Extra inputs are not permitted",
            "did you mean 'lease_timeout_seconds'?",
        ],
    ),
    "unknown section": (
        {"trainers": {"total_steps": 3}},
        ["trainers: Extra inputs are not permitted", "did you mean 'trainer'?"],
    ),
    "unknown key in a discriminated union": (
        {"rollout": {"engine": {"kind": "sglang", "urll": "http://x"}}},
        ["rollout.engine.sglang.urll: Extra inputs are not permitted", "did you mean 'url'?"],
    ),
    "unknown key with no close match": (
        {"tls": {"zzz": 1}},
        ["tls.zzz: Extra inputs are not permitted", "known fields here: ca_file, cert_file"],
    ),
    "a section that is not a mapping": (
        {"trainer": [1, 2]},
        ["trainer: Input should be a valid dictionary"],
    ),
    "not a mapping at all": ("- just\n- a list\n", ["must be a mapping of sections"]),
    "greedy sampling with dynamic sampling": (
        {"rollout": {"sampling": {"temperature": 0}}, "buffer": {"dynamic_sampling": True}},
        [
            "buffer.dynamic_sampling with rollout.sampling.temperature 0",
            "set rollout.sampling.temperature > 0",
        ],
    ),
    "NCCL-only weight transport on a CPU-only run": (
        {"job": {"local": {"device": "cpu"}}, "weight_sync": {"transports": ["nccl"]}},
        [
            "weight_sync.transports ['nccl'] needs GPUs but job.local.device is cpu",
            "add gloo, shm or snapshot",
        ],
    ),
    "SGLang engines left only NCCL by a relay without a GPU": (
        {"rollout": {"engine": {"kind": "sglang"}}, "weight_sync": {"transports": ["nccl"]}},
        [
            "weight_sync.transports ['nccl'] makes nccl the only route to SGLang engines",
            "weight_sync.device is cpu and the relay sends NCCL only from a GPU",
            "set weight_sync.device: cuda",
            "or add snapshot to weight_sync.transports",
        ],
    ),
    "SGLang engines offered no route they take": (
        {"rollout": {"engine": {"kind": "sglang"}}, "weight_sync": {"transports": ["gloo", "shm"]}},
        ["names neither route SGLang engines (rollout.engine.kind: sglang) take, nccl or snapshot"],
    ),
    "CUDA engine on a CPU-only run": (
        {
            "job": {"local": {"device": "cpu"}},
            "rollout": {"engine": {"kind": "torch", "device": "cuda:0"}},
        },
        [
            "rollout.engine.device 'cuda:0' but job.local.device is cpu",
            "set rollout.engine.device: cpu",
        ],
    ),
    "SGLang launched on a CPU-only run": (
        {
            "job": {"local": {"device": "cpu"}},
            "rollout": {"engine": {"kind": "sglang", "launch": True}},
        },
        [
            "rollout.engine.launch starts an SGLang server, which needs a GPU",
            "use rollout.engine.kind: torch",
        ],
    ),
    "GRPO with one sample per prompt": (
        {"rollout": {"group_size": 1}},
        ["rollout.group_size must be >= 2 for advantage 'grpo'"],
    ),
    # Accepted until 2026-11-26: every group dropped as stale, the trainer waiting for good.
    "engines further behind between publishes than the staleness bound": (
        {"trainer": {"publish_every": 2, "max_staleness": 0}},
        ["trainer.publish_every 2 with trainer.max_staleness 0", "max_staleness >= publish_every"],
    ),
    # Accepted until 2026-11-26: every group of one sample dropped as zero-variance.
    "dynamic sampling on groups of one": (
        {
            "rollout": {"group_size": 1},
            "trainer": {"algorithm": {"advantage": "reinforce_pp"}},
            "buffer": {"dynamic_sampling": True},
        },
        ["buffer.dynamic_sampling with rollout.group_size 1"],
    ),
    # Accepted until 2026-11-26: the buffer loaded the second as 'already loaded', its prompts
    # silently missing.
    "two datasets of one name": (
        {"data": {"train": [{"path": "a/train.jsonl"}], "eval": [{"path": "b/train.jsonl"}]}},
        ["data.eval[0] (b/train.jsonl) and data.train[0] (a/train.jsonl) are both named 'train'"],
    ),
    "mutual TLS without TLS": (
        {"tls": {"require_client_cert": True}},
        ["tls: Value error, require_client_cert needs TLS: set tls.enabled: true"],
    ),
    "mutual TLS without a CA": (
        {"tls": {"enabled": True, "cert_file": "a", "key_file": "b", "require_client_cert": True}},
        ["require_client_cert: servers check client certificates against ca_file; set tls.ca_file"],
    ),
    "certificate without its key": (
        {"tls": {"enabled": True, "cert_file": "a"}},
        ["cert_file and key_file go together: set both or neither"],
    ),
    # Accepted until 2026-11-26; the buffer then failed at start, `buffer stats` with a
    # traceback.
    "a Redis URL of another scheme": (
        {"redis": {"url": "http://redis:6379"}},
        ["url 'http://redis:6379' is not a Redis URL"],
    ),
    "Redis TLS files with a plaintext URL": (
        {"redis": {"url": "redis://r:6379/0", "tls_ca_file": "ca.pem"}},
        ["redis: Value error, tls_*_file are set but url is not rediss://", "use url: rediss://"],
    ),
}


@pytest.fixture
def check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., tuple[int, str]]:
    """`kuberl config check JOB` run in this process (the same `main` as the console script, no
    service is started): its exit code and stderr."""
    from kuberl.cli import main

    for name in [n for n in os.environ if n.startswith("KUBERL_")]:
        monkeypatch.delenv(name)

    def run(job: Path, **env: str) -> tuple[int, str]:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        code = main(["config", "check", str(job)])
        return code, capsys.readouterr().err

    return run


@pytest.mark.parametrize("case", list(CHECK_CASES))
def test_config_check_refuses_the_job_naming_the_field_and_the_fix(
    tmp_path: Path, check: Callable[..., tuple[int, str]], case: str
) -> None:
    doc, expected = CHECK_CASES[case]
    code, stderr = check(_job(tmp_path, doc))
    missing = [line for line in expected if line not in stderr]
    assert (code, missing) == (2, []), stderr


def test_config_check_accepts_the_examples_and_a_console_script_exits_2(tmp_path: Path) -> None:
    good = _kuberl("config", "check", str(REPO / "examples" / "demo.yaml"))
    bad = _kuberl("config", "check", str(_job(tmp_path, {"buffer": {"nope": 1}})))
    assert (good.returncode, bad.returncode) == (0, 2)
    assert bad.stderr.startswith("kuberl: ") and "buffer.nope" in bad.stderr


def test_an_environment_override_of_the_wrong_type_names_its_variable(
    tmp_path: Path, check: Callable[..., tuple[int, str]]
) -> None:
    code, stderr = check(_job(tmp_path, {}), KUBERL_TRAINER__ZERO_STAGE="7")
    assert code == 2
    assert "trainer.zero_stage: Input should be 0, 1, 2 or 3 (got 7)" in stderr
    assert "(from environment KUBERL_TRAINER__ZERO_STAGE)" in stderr


# (service, job document, the lines stderr must contain)
SERVE_CASES: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "rollout, model.path missing": (
        "rollout",
        {"model": {"path": "/nonexistent/model"}},
        [
            "cannot start rollout",
            "model.path: /nonexistent/model/config.json does not exist",
            "set model.path: null to build a small model",
        ],
    ),
    "trainer, model.path missing": (
        "trainer",
        {"model": {"path": "./models/not-here"}},  # `models/not-here` would be a hub id
        ["models/not-here/config.json does not exist"],
    ),
    "trainer, a hub id not in the cache, offline": (
        "trainer",
        {"model": {"path": "no-org/no-model"}},
        ["model.path: no-org/no-model is not in the Hugging Face cache", "hf download no-org/no-"],
    ),
    "trainer, sft_data missing": (
        "trainer",
        {"trainer": {"mode": "sft", "sft_data": "/nonexistent/sft.jsonl"}},
        ["trainer.sft_data: /nonexistent/sft.jsonl does not exist", "set trainer.sft_data: null"],
    ),
    "buffer, dataset missing": (
        "buffer",
        {"data": {"train": [{"path": "/nonexistent/train.jsonl"}]}},
        ["data.train[0].path: /nonexistent/train.jsonl does not exist", "fix the path"],
    ),
    "reward, reward model missing": (
        "reward",
        {"reward": {"verifiers": {"rm": 1.0}, "reward_model": {"path": "/nonexistent/rm"}}},
        ["reward.reward_model.path: /nonexistent/rm/config.json does not exist"],
    ),
    "weight-sync, TLS certificate missing": (
        "weight_sync",
        {
            "tls": {
                "enabled": True,
                "cert_file": "/nonexistent/tls.crt",
                "key_file": "/nonexistent/tls.key",
            }
        },
        ["tls.cert_file: /nonexistent/tls.crt does not exist", "mount the TLS secret there"],
    ),
}


@pytest.mark.parametrize("case", list(SERVE_CASES))
def test_serve_refuses_to_start_without_the_files_the_service_reads(
    tmp_path: Path, case: str
) -> None:
    service, doc, expected = SERVE_CASES[case]
    doc = {**doc, service: {**doc.get(service, {}), "server": LOCAL}}
    job = _job(tmp_path, doc)
    checked = _kuberl("config", "check", str(job))
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}  # never the real hub
    served = _kuberl(
        "serve", service, "--config", str(job), "--port-file", str(tmp_path / "p"), env=offline
    )
    missing = [line for line in expected if line not in served.stderr]
    assert (checked.returncode, served.returncode, missing) == (0, 2, []), served.stderr
    assert not (tmp_path / "p").exists()  # it never listened


def test_a_tls_file_that_is_not_pem_is_refused_at_start(tmp_path: Path) -> None:
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).write_text("not a certificate\n")
    doc = {
        "tls": {
            "enabled": True,
            "cert_file": str(tmp_path / "tls.crt"),
            "key_file": str(tmp_path / "tls.key"),
        },
        "weight_sync": {"server": LOCAL, "shm_dir": str(tmp_path / "shm")},
    }
    result = _kuberl("serve", "weight_sync", "--config", str(_job(tmp_path, doc)))
    assert result.returncode == 2
    assert f"tls.key_file: {tmp_path / 'tls.key'} is not a PEM file" in result.stderr
