"""The buffer's glibc malloc settings (`kuberl.buffer.allocator`): applied at start, and never
over a setting the operator chose with glibc's MALLOC_*_ environment variables."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="mallopt settings exist only in glibc"
)


def applied(env: dict[str, str]) -> dict[str, int]:
    """What keep_freed_memory() applies in a fresh process with env (it changes that process)."""
    code = (
        "import json; from kuberl.buffer.allocator import keep_freed_memory; "
        "print(json.dumps(keep_freed_memory()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_the_buffer_raises_the_mmap_and_trim_thresholds_of_glibc() -> None:
    assert applied({}) == {
        "MALLOC_MMAP_THRESHOLD_": 32 * 1024 * 1024,
        "MALLOC_TRIM_THRESHOLD_": 128 * 1024 * 1024,
        "MALLOC_TOP_PAD_": 16 * 1024 * 1024,
    }


def test_a_threshold_set_in_the_environment_is_left_as_the_operator_chose() -> None:
    assert sorted(applied({"MALLOC_TRIM_THRESHOLD_": "0"})) == [
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TOP_PAD_",
    ]
