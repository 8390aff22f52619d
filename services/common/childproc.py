"""Starting child processes that die with their parent, safely from a threaded process.

The local supervisor's processes (`kuberl.local.procs`) and the embedded Redis wrap their commands
with `die_with_parent`, so a parent that dies leaves no orphan. It avoids
`subprocess.Popen(preexec_fn=...)`, which runs Python between fork and exec: in a process with other
threads (gRPC's, for one) a lock another thread held at fork time can deadlock or abort the child
before it execs.
"""

from __future__ import annotations

import os
import signal
import sys

# argv: signal, the parent's pid, the program. A parent that died before the prctl (the child's
# interpreter takes tens of ms to get there) never sends the signal: the child has been
# reparented by then, so it checks and sends the signal to itself.
_SET_PDEATHSIG_AND_EXEC = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    os.kill(os.getpid(), int(sys.argv[1]))\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def die_with_parent(argv: list[str], sig: int = signal.SIGKILL) -> list[str]:
    """`argv` wrapped so that Linux sends `sig` to the program when the thread that started it
    exits (PR_SET_PDEATHSIG). Pass the result to `subprocess.Popen` without a `preexec_fn`.

    The child execs a tiny interpreter that sets the signal and then execs the program: the
    setting survives execve (for programs without setuid bits or file capabilities), and the
    pid stays the same, so `Popen.pid` is the program's pid."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    parent = str(os.getpid())
    return [sys.executable, "-I", "-S", "-c", _SET_PDEATHSIG_AND_EXEC, str(int(sig)), parent, *argv]
