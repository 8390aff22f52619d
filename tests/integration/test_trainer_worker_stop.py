"""A SIGTERM that reaches only a worker rank (its pod evicted, a node drained) stops the whole
trainer with a last checkpoint: two ranks under torchrun (gloo), an SFT job from a file, and the
signal sent to rank 1's process alone. The stop decision was rank 0's: the worker ignored it
until torchrun killed it, and the job failed without its last steps checkpointed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kuberl.local.accounting import read_rows
from tests.integration.test_trainer_sft_resume import _write_job
from tests.support import REPO

TOTAL = 400


def _rank_one(parent: int) -> int | None:
    """The pid of the `kuberl serve trainer` process of rank 1 below `parent` (torchrun)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"RANK=1" in env and b"serve" in cmdline:
            return int(entry.name)
    return None


@pytest.mark.slow
def test_a_sigterm_to_a_worker_rank_alone_stops_the_job_with_a_checkpoint(tmp_path: Path) -> None:
    import yaml

    from kuberl.common.modelbuild import build_model

    model = build_model(tmp_path / "model", tokenizer="digits", seed=5)
    job = _write_job(tmp_path, model)
    doc = yaml.safe_load(job.read_text())
    doc["trainer"].update(total_steps=TOTAL, checkpoint_every=1000)  # only the stop checkpoints
    job.write_text(yaml.safe_dump(doc))
    metrics = tmp_path / "metrics.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(KUBERL_METRICS_JSONL=str(metrics), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    log = (tmp_path / "torchrun.log").open("wb")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
            *("-m", "kuberl.cli", "serve", "trainer", "--config", str(job)),
        ],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not any(r.get("step", 0) >= 3 for r in read_rows(metrics)):
            assert proc.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the trainer never reached step 3"
            time.sleep(0.2)
        worker = _rank_one(proc.pid)
        assert worker is not None, "rank 1's process not found"
        os.kill(worker, signal.SIGTERM)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    latest = tmp_path / "ckpt" / (tmp_path / "ckpt" / "latest").read_text().strip()
    saved = json.loads((latest / "cursor.json").read_text())["step"]
    trained = max(r["step"] for r in read_rows(metrics) if r.get("kind") == "sft")
    assert (code, 3 <= saved < TOTAL, saved) == (0, True, trained), (
        tmp_path / "torchrun.log"
    ).read_text()[-3000:]
