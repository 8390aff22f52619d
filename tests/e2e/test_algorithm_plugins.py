"""`kuberl run` trains with algorithm plugins named by path in the job file.

examples/custom-algorithms.yaml, cut to three RL steps without the warm start, names the advantage
estimator and policy loss of examples/plugins/custom_algorithms.py. The trainer's per-step
metrics must show that both ran: a fixed-baseline advantage is +-0.5 on every token for rewards
0 or 1 (GRPO's would be 0 or a multiple of a group's std), and only the CISPO loss reports
policy/cispo_weight. A plugin of the wrong signature ends the run, naming the field.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import REPO


def _run_example(tmp: Path, **algorithm: str) -> subprocess.CompletedProcess[str]:
    """examples/custom-algorithms.yaml cut to three RL steps (no warm start, no eval)."""
    doc = yaml.safe_load((REPO / "examples" / "custom-algorithms.yaml").read_text())
    doc["rollout"]["sampling"]["max_new_tokens"] = 4
    doc["trainer"].update(
        total_steps=3, groups_per_step=4, eval_every=0, checkpoint_every=0, sft_steps=0
    )
    doc["trainer"]["algorithm"].update(algorithm)
    doc["data"]["eval"] = []
    doc["job"]["local"]["max_restarts"] = 0
    job = tmp / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    return subprocess.run(
        [sys.executable, "-m", "kuberl.cli", "run", str(job), "--run-dir", str(tmp / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.fixture(scope="module")
def rl_rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("algorithm-plugins")
    run_dir = tmp / "run"
    proc = _run_example(tmp)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row.get("kind") == "rl"]


@pytest.mark.slow
def test_every_step_used_the_plugin_advantage_estimator(rl_rows: list[dict[str, Any]]) -> None:
    assert [row["advantages/abs_max"] for row in rl_rows] == [0.5, 0.5, 0.5]


@pytest.mark.slow
def test_every_step_used_the_plugin_policy_loss(rl_rows: list[dict[str, Any]]) -> None:
    weights = [row.get("policy/cispo_weight") for row in rl_rows]
    assert len(weights) == 3 and all(w is not None and 0.8 <= w <= 1.28 for w in weights)


@pytest.mark.slow
def test_a_plugin_of_the_wrong_signature_ends_the_run_naming_the_field(tmp_path: Path) -> None:
    proc = _run_example(tmp_path, advantage="tests.plugin_contracts.algorithm_plugins:one_argument")
    out = proc.stdout + proc.stderr
    expected = (
        "trainer.algorithm.advantage: advantage estimator "
        "'tests.plugin_contracts.algorithm_plugins:one_argument': wrong signature"
    )
    assert (proc.returncode != 0, expected in out, "one_argument(inputs, config)" in out) == (
        True,
        True,
        True,
    ), out[-4000:]
