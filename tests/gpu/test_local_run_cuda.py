"""`kuberl run --device cuda` on one GPU: the trainer publishes by CUDA IPC and the colocated
torch engine loads its versions device to device.

The shortened demo of tests/e2e/test_local_run.py (no warm start, 3 GRPO steps, small groups)
with `--device cuda`: the trainer and one torch rollout replica share GPU 0 and weight-sync
offers `cuda_ipc` first. The replica's log line `engine.update_loaded` names the transport of
every version it loaded; at least one after the start must be `cuda_ipc` (a version published
while the engine was still loading the previous one goes by shared memory instead, so not
every one need be).

Skips cleanly without CUDA; tests/unit/test_trainer_publisher_options.py checks on the CPU what
the trainer offers. On an H200 (2026-11-26) the run stalled at v0: weight-sync refused torch's
66-byte CUDA IPC handles, then the retry of the refused version as stale. Fixed in commits f9b0bcb
(handles) and cbd5108 (a refused version is forgotten; the publisher drops cuda_ipc once its
handles are refused), tested on CPU; not yet re-run on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.test_local_run import _short_job
from tests.support import REPO

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    # The run may take up to its own 900 s subprocess timeout; pytest's global limit is 300 s.
    pytest.mark.timeout(960),
]


def loaded_versions(log: Path) -> list[tuple[int, str]]:
    """(version, transport) of every `engine.update_loaded` line of a service's key=value log."""
    loads = []
    for line in log.read_text().splitlines():
        fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        if fields.get("event") == "engine.update_loaded":
            loads.append((int(fields["version"]), fields["transport"]))
    return loads


def test_kuberl_run_on_one_gpu_loads_versions_into_the_engine_by_cuda_ipc(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable, "-m", "kuberl.cli", "run", str(_short_job(tmp_path, warm_start=False)),
            "--device", "cuda", "--run-dir", str(run_dir), "--plain",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    loads = loaded_versions(run_dir / "logs" / "rollout-0.log")
    assert any(v >= 1 and t == "cuda_ipc" for v, t in loads), loads
