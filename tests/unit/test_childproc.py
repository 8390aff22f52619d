"""`die_with_parent`: children that die with the process that started them."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kuberl.common.childproc import die_with_parent
from tests.support import process_alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")


def test_the_program_runs_with_its_own_pid_and_exit_code() -> None:
    code = "import os, sys; print(os.getpid()); sys.exit(3)"
    proc = subprocess.Popen(die_with_parent([sys.executable, "-c", code]), stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=30)
    assert (proc.returncode, int(out)) == (3, proc.pid)


def test_a_child_is_killed_when_its_parent_dies() -> None:
    # The parent starts a child that would sleep a minute, prints its pid and exits at once.
    parent = textwrap.dedent(
        """
        import subprocess, sys
        from kuberl.common.childproc import die_with_parent
        sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
        child = subprocess.Popen(die_with_parent(sleeper))
        print(child.pid, flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and process_alive(pid):
        time.sleep(0.05)
    assert not process_alive(pid)


def test_a_child_whose_parent_died_before_the_signal_was_set_kills_itself() -> None:
    # What the child sees when its parent died before its prctl: another parent pid than the
    # one it was given. (Here the parent pid it is given is made wrong on purpose.)
    argv = die_with_parent([sys.executable, "-c", "import time; time.sleep(60)"], signal.SIGTERM)
    at = argv.index(str(signal.SIGTERM.value)) + 1
    argv[at] = "1"  # not this process
    proc = subprocess.Popen(argv)
    assert proc.wait(30) == -signal.SIGTERM
