"""benchmarks/scale.py at a tiny N (the full N = 4..256 run is `make bench`'s): it runs real
services around simulated replicas and ends with the JSON line the report reads."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.benchmarks import load
from tests.support import REPO

TINY = [
    "--replicas", "2", "--hosts", "1", "--seconds", "2", "--idle-seconds", "1",
    "--tokens-per-second", "2000", "--no-saturate",
]  # fmt: skip


def _scale(*args: str) -> tuple[dict[str, Any], str]:
    """scale.py at TINY plus `args`: its JSON line, and what it printed on stderr."""
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "scale.py"), *TINY, *args],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_scale_runs_two_replicas_end_to_end_and_the_report_reads_its_line() -> None:
    result, _ = _scale("--payload-mb", "1", "--fan-out-mb", "0.2", "--pod-mb-per-s", "2")
    [run] = result["runs"]
    assert run["replicas"] == 2 and run["trajectories"] > 0 and run["errors"]["failures"] == 0
    assert run["lease_ms"]["calls"] > 0 and run["put_ms"]["calls"] > 0
    assert run["fan_out"]["engines_holding"] == 2
    relay = result["fan_out"]["relay"]["2"]
    star = result["fan_out"]["star"]["2"]
    # The star streams both copies itself; the relay's second engine gets it from the first.
    assert star["weight_sync_bytes_sent"] == 2 * star["payload_bytes"]
    assert relay["weight_sync_bytes_sent"] + relay["relayed_bytes"] == 2 * relay["payload_bytes"]
    assert result["machine"]["loadavg_1m_at_start"] >= 0
    assert load("report").ROWS["scale"]({"benchmark": "scale", **result})


def test_no_fan_out_measures_latency_and_cpu_without_publishing_a_version() -> None:
    result, stderr = _scale("--no-fan-out")
    [run] = result["runs"]
    assert run["lease_ms"]["calls"] > 0 and run["put_ms"]["calls"] > 0
    assert "fan_out" not in run and result["fan_out"] == {}
    assert "fan-out" not in stderr
