"""benchmarks/response_head.py: a small run times the policy's step both ways (the script
refuses to report when their losses differ) and prints one JSON line per prompt share.
benchmarks/activation_checkpointing.py: a small run measures the three settings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO


def test_a_small_run_prints_both_timings_for_each_prompt_share() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/response_head.py", "--seq-len", "64", "--rounds", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (result["benchmark"], sorted(result["shares"])) == ("response_head", ["0.25", "0.75"])
    for share, x in result["shares"].items():
        assert x["prompt_tokens"] == round(float(share) * 64)
        assert x["prompt_tokens"] + x["response_tokens"] == 64
        assert x["speedup"] == pytest.approx(
            x["every_position_seconds"] / x["response_only_seconds"], rel=0.01
        )


def test_activation_checkpointing_prints_memory_and_time_of_each_setting() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/activation_checkpointing.py", "--seq-len", "128"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    modes = json.loads(out.stdout.strip().splitlines()[-1])["modes"]
    memory = [modes[m]["activation_mib"] for m in ("whole_layers", "selective", "none")]
    assert memory == sorted(memory) and modes["none"]["memory_vs_none"] == 1.0
