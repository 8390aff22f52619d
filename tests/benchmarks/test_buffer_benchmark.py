"""benchmarks/buffer_throughput.py: rounds start on a Redis that rewrites nothing in the
background, and a small run prints both figures with each round's forks (real Redis, the real
buffer service in a subprocess). benchmarks/put_encoding.py: a small run prints both encodings
of one rollout put."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from kuberl.common.redis_server import EmbeddedRedis
from tests.benchmarks import load
from tests.support import REPO

bench = load("buffer_throughput")


def test_settling_waits_for_a_running_aof_rewrite_to_end(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "redis", die_with_parent=True) as server:
        client = redis.Redis.from_url(server.url)
        client.set("k", b"x" * 1_000_000)
        forks = bench._forks(client)
        client.bgrewriteaof()
        bench.settle_redis(client)
        info = client.info("persistence")
        assert (info["aof_rewrite_in_progress"], info["aof_last_bgrewrite_status"]) == (0, "ok")
        assert bench._forks(client) == forks + 1


def _last_line(script: str, *args: str) -> dict[str, Any]:
    """The JSON line a benchmark script prints last, from a run with these arguments."""
    out = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_a_small_run_prints_both_figures_and_each_rounds_forks() -> None:
    # --tuned-clients: the producers (spawned) and the consumers take the malloc settings too.
    result = _last_line(
        "buffer_throughput.py", "--groups", "32", "--rounds", "1", "--tuned-clients"
    )
    assert result["client_malloc"] == "buffer's settings, both sides"
    assert result["service_traj_per_s"] > 0 and result["raw_redis_traj_per_s"] > 0
    ratio = result["service_traj_per_s"] / result["raw_redis_traj_per_s"]
    assert result["ratio_service_to_raw"] == pytest.approx(ratio, abs=2e-3)
    assert {k: len(v) for k, v in result["redis_forks"].items()} == {"service": 1, "raw": 1}


def test_put_encoding_prints_both_encodings_of_one_request() -> None:
    # The script itself refuses to report when the two encodings parse differently.
    result = _last_line("put_encoding.py", "--requests", "3", "--rounds", "2")
    assert result["request_bytes"] > 8 * 8 * 2048 * 9  # ids + logprobs + mask per token
    assert result["speedup"] == pytest.approx(
        result["one_piece_ms_per_request"] / result["by_group_ms_per_request"], rel=0.05
    )
