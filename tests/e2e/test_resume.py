"""`kuberl run --resume RUN_DIR`: a run stopped with Ctrl-C (SIGINT) mid-training goes on in its
own folder, every service restarted from the run's checkpoint and its embedded Redis' AOF, and
ends as if it had never stopped: the step count of the job, no prompt lost, no group trained
twice (summary.json, which counts across both parts from trained.jsonl and the buffer)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_python_api import SHORT
from tests.support import REPO

STEPS = 5


def _kuberl(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kuberl.cli", "run", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _rl_steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0
    return sum('"kind": "rl"' in line for line in metrics.read_text().splitlines())


@pytest.mark.slow
def test_a_run_stopped_mid_training_resumes_and_ends_as_if_never_stopped(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [o for o in SHORT if not o.startswith("trainer.total_steps")]
    first = _kuberl(
        "examples/demo.yaml",
        "--run-dir",
        str(run_dir),
        *overrides,
        f"trainer.total_steps={STEPS}",
        "trainer.checkpoint_every=1",
    )
    try:
        deadline = time.monotonic() + 200
        while _rl_steps(run_dir) < 2 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        first.send_signal(signal.SIGINT)
        out_first, _ = first.communicate(timeout=150)
    finally:
        if first.poll() is None:
            first.kill()
    stopped = json.loads((run_dir / "summary.json").read_text())
    assert (first.returncode, stopped["status"]) == (130, "interrupted"), out_first[-3000:]
    assert stopped["steps"] < STEPS, "stopped too late to test a resume"

    second = _kuberl("--resume", str(run_dir))
    out, _ = second.communicate(timeout=300)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (
        second.returncode,
        summary["status"],
        summary["steps"],
        summary["prompts_lost"],
        summary["groups_duplicated"],
        summary["groups_trained_twice"],
    ) == (0, "completed", STEPS, 0, 0, 0), out[-4000:]
    # The trainer went on from its checkpoint (not from step 0), in the same folder.
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "trainer.resumed" in trainer_log
