"""`kuberl health`, what the chart's `helm test` pod runs, against a real server under kuberl's
gRPC bootstrap in a subprocess: it waits through NOT_SERVING and fails on what never answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kuberl.common.redis_server import PortReservation
from tests.support import REPO, ServiceProcess

APP = [sys.executable, str(REPO / "tests" / "integration" / "bootstrap_app.py")]


def _health(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kuberl.cli", "health", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


def test_health_waits_until_the_service_is_ready(tmp_path: Path) -> None:
    with ServiceProcess([*APP, "--ready-delay", "1.5"], tmp_path, "app") as app:
        app.wait_listening()
        result = _health("--timeout", "30", app.address)
    assert (result.returncode, result.stdout) == (0, f"{app.address} SERVING\n")


def test_health_fails_and_names_the_service_that_never_answered(tmp_path: Path) -> None:
    held = PortReservation()  # bound, never listening, and no other process can take it
    silent = f"127.0.0.1:{held.take()}"
    try:
        with ServiceProcess(APP, tmp_path, "app") as app:
            app.wait_serving()
            result = _health("--timeout", "1", app.address, silent)
    finally:
        held.release()
    assert result.returncode == 1
    assert result.stdout.splitlines() == [f"{app.address} SERVING", f"{silent} UNAVAILABLE"]
