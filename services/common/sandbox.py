"""Running untrusted Python in a separate, isolated process, from a service's event loop.

Two services use it: the reward service's `code` verifier (`Sandbox.run`: a program against its
tests, `reward.sandbox`) and the rollout service's `python` tool (`Sandbox.execute`: a snippet
run once, its raw output back, `rollout.multi_turn.sandbox`). Each run starts
`sandbox_launcher.py`, which isolates and runs the code, in its own session with a scrubbed
environment, sends it the job and reads back one JSON report; at most `max_concurrent` run at
once. `Sandbox.probe` reports which isolation the host allows, and the caller decides whether
that is enough (`require_isolation`); what holds with and without root: docs/reward.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kuberl.common.config import SandboxConfig
from kuberl.common.logs import get_logger

log = get_logger(__name__)

LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
# Seconds the launcher gets beyond the run's deadline to clean up and report before the
# service stops trusting it.
BACKSTOP_SECONDS = 3.0
#: What each aspect of a launcher's isolation report is when a run is fully isolated (as root).
FULL_ISOLATION = {"network": "namespace", "files": "private", "uid": "dedicated"}
PR_SET_DUMPABLE = 4


class SandboxError(Exception):
    """A run produced no report: `reason` is `timeout` (the launcher overran its deadline and
    was killed) or `sandbox` (the launcher itself failed); the message says what happened."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass
class SandboxRun:
    """Per-test results (`status`, `detail`) of one run and the isolation it had."""

    results: list[dict[str, str]]
    isolation: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class SandboxOutput:
    """What one `execute` produced. `status`: `exited` (see `returncode`), `timeout` (wall
    clock or CPU time, `detail` says which) or `output_limit` (stdout passed
    `max_output_bytes`; what came before is kept)."""

    status: str
    returncode: int
    stdout: str
    stderr: str  # the last 4 KiB
    detail: str = ""
    isolation: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def _world_executable(path: str) -> bool:
    """True when a user with no rights but `other` bits can execute `path`."""
    p = Path(path)
    try:
        if not p.stat().st_mode & stat.S_IXOTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in p.parents)
    except OSError:
        return False


def default_python(dedicated_uid: bool) -> str:
    """The interpreter for sandboxed programs when the job names none.

    The service's own base interpreter if a dedicated uid can reach it (a pyenv under /root
    cannot be), else the first `python3` on PATH that it can.
    """
    own = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if not dedicated_uid:
        return own
    candidates = [own, shutil.which("python3") or "", "/usr/bin/python3", "/usr/local/bin/python3"]
    for candidate in candidates:
        if candidate and _world_executable(os.path.realpath(candidate)):
            return os.path.realpath(candidate)
    return own


def protect_process() -> None:
    """Without root, sandboxed code shares this process's uid: make it non-dumpable so that code
    cannot read its /proc/<pid>/environ or memory (it would hold the service's secrets)."""
    if os.geteuid() != 0:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


UID_LOCK_DIR = Path(tempfile.gettempdir()) / "kuberl-sandbox-uids"
UID_SEARCH_SPAN = 4096


def claim_uids(
    base: int,
    count: int,
    lock_dir: Path = UID_LOCK_DIR,
    setting: str = "reward.sandbox.uid_base or rollout.multi_turn.sandbox.uid_base",
) -> tuple[list[int], list[int]]:
    """Claim `count` uids from `base` upwards that no other live process on this host holds.

    Each uid is held by an exclusive flock on `lock_dir/<uid>.lock` (released by the kernel when
    the holder exits, so a killed service frees its ids). Returns the uids and the open lock
    descriptors, which must stay open for as long as the uids are in use.
    """
    lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    uids: list[int] = []
    fds: list[int] = []
    for uid in range(base, base + UID_SEARCH_SPAN):
        fd = os.open(lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        uids.append(uid)
        fds.append(fd)
        if len(uids) == count:
            return uids, fds
    for fd in fds:
        os.close(fd)
    raise RuntimeError(
        f"no {count} free sandbox uids in [{base}, {base + UID_SEARCH_SPAN}): other sandboxes "
        f"(reward or rollout services) on this host hold them (see {lock_dir}); set {setting}"
    )


#: How long a launcher asked to stop (SIGTERM) may take to kill and reap its programs.
STOP_SECONDS = 3.0


async def stop_launcher(proc: asyncio.subprocess.Process) -> None:
    """End a launcher the service gives up on and everything its programs started: SIGTERM
    first, on which it kills and reaps every process below it (programs run in sessions of
    their own, which a kill of its process group would not reach); its process group is
    SIGKILLed if it is not gone within STOP_SECONDS."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), STOP_SECONDS)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


class Sandbox:
    """Runs untrusted programs with one `SandboxConfig`'s limits.

    `setting` is where that configuration lives in the job file (`reward.sandbox`,
    `rollout.multi_turn.sandbox`); error messages name it. Each run holds one of
    `max_concurrent` slots; as root each slot owns a dedicated uid, claimed here (`claim_uids`,
    so no other sandbox on the host hands it out) and held until `close()` or the process exits.
    A launcher that overruns its deadline is killed with its programs (`SandboxError`, timeout).
    """

    def __init__(self, config: SandboxConfig, *, setting: str) -> None:
        self.config = config
        self.setting = setting
        self.root = os.geteuid() == 0
        protect_process()
        self.python = config.python or default_python(self.root)
        self._slots: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(config.max_concurrent):
            self._slots.put_nowait(slot)
        self.isolation: dict[str, str] = {}
        self._uids: list[int] = []
        self._uid_locks: list[int] = []
        if self.root:
            self._uids, self._uid_locks = claim_uids(
                config.uid_base, config.max_concurrent, setting=f"{setting}.uid_base"
            )

    @property
    def uids(self) -> list[int]:
        """The uids this sandbox's slots run programs as (empty without root)."""
        return list(self._uids)

    def close(self) -> None:
        """Release the claimed uids (no run may be in progress)."""
        for fd in self._uid_locks:
            os.close(fd)
        self._uid_locks = []

    def _uid(self, slot: int) -> int | None:
        return self._uids[slot] if self.root else None

    def _job(
        self,
        mode: str,
        code: str,
        deadline: float,
        slot: int,
        workdir: str,
        wall_seconds: float | None = None,
    ) -> dict[str, Any]:
        c = self.config
        return {
            "mode": mode,
            "uid": self._uid(slot),
            "python": self.python,
            "no_site": c.python is None,
            "code": code,
            "workdir": workdir,
            "deadline_seconds": deadline,
            "limits": {
                "cpu_seconds": c.cpu_seconds,
                "memory_bytes": c.memory_bytes,
                "max_processes": c.max_processes,
                "max_file_bytes": c.max_file_bytes,
                "max_open_files": c.max_open_files,
                "wall_seconds": wall_seconds or c.wall_seconds,
                "max_output_bytes": c.max_output_bytes,
                "tmpfs_bytes": c.tmpfs_bytes,
            },
        }

    async def _launch(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-S",
            str(LAUNCHER),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(json.dumps(job).encode()), timeout)
        except BaseException:  # timeout or cancellation: nothing of the run may survive
            await stop_launcher(proc)
            if job.get("uid") is not None:
                await self._reap(job["uid"])
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
            raise SandboxError(
                "sandbox", f"sandbox launcher failed (exit {proc.returncode}): {tail[0][:300]}"
            )
        return dict(json.loads(out))

    async def _reap(self, uid: int) -> None:
        """Kill every process of `uid` (after a launcher had to be killed)."""
        reaper = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-S",
            str(LAUNCHER),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            env={},
        )
        await reaper.communicate(json.dumps({"mode": "reap", "uid": uid}).encode())

    async def _session(
        self, mode: str, code: str, timeout: float, wall_seconds: float | None, **extra: Any
    ) -> tuple[dict[str, Any], float]:
        """One launcher run in a free slot: its report and the seconds it took (from the slot)."""
        slot = await self._slots.get()
        started = time.monotonic()
        workdir = tempfile.mkdtemp(prefix="kuberl-sandbox-")
        try:
            # The launcher stops starting programs at the deadline; the backstop is only for a
            # launcher that does not come back.
            deadline = max(timeout - 0.5, 0.1)
            job = self._job(mode, code, deadline, slot, workdir, wall_seconds) | extra
            try:
                report = await self._launch(job, deadline + BACKSTOP_SECONDS)
            except TimeoutError:
                message = f"sandbox did not finish within {timeout:g}s"
                raise SandboxError("timeout", message) from None
            return report, time.monotonic() - started
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            self._slots.put_nowait(slot)

    async def run(
        self,
        code: str,
        tests: list[dict[str, str]],
        timeout: float,
        wall_seconds: float | None = None,
    ) -> SandboxRun:
        """Run `code` against `tests` within `timeout` seconds (SandboxError otherwise)."""
        report, seconds = await self._session("run", code, timeout, wall_seconds, tests=tests)
        return SandboxRun(report["results"], report["isolation"], seconds)

    async def execute(
        self, code: str, timeout: float, wall_seconds: float | None = None
    ) -> SandboxOutput:
        """Run `code` once as a script (no stdin) and return what it wrote.

        The program gets `wall_seconds` (default: the config's) of wall clock; the whole run,
        launcher included, `timeout` seconds from when a slot is free (SandboxError otherwise).
        """
        report, seconds = await self._session("exec", code, timeout, wall_seconds)
        out = report["output"]
        return SandboxOutput(
            status=out["status"],
            returncode=out["returncode"],
            stdout=out["stdout"],
            stderr=out["stderr"],
            detail=out["detail"],
            isolation=report["isolation"],
            seconds=seconds,
        )

    async def probe(self) -> dict[str, str]:
        """Run `print(1)` once; return (and remember) the isolation this host gives."""
        # Generous limits: a loaded machine must not make a healthy sandbox look broken.
        hint = f"set {self.setting}.python to an interpreter the sandbox user can execute"
        try:
            run = await self.run("print(1)", [{"input": "", "output": "1"}], 60.0, 30.0)
        except SandboxError as exc:
            raise RuntimeError(
                f"the code sandbox cannot run {self.python}: {exc}; {hint}"
            ) from None
        if run.results[0]["status"] != "passed":
            raise RuntimeError(
                f"the code sandbox cannot run {self.python}: {run.results[0]}; {hint}"
            )
        self.isolation = run.isolation
        return run.isolation

    @property
    def fully_isolated(self) -> bool:
        """Own network namespace, private /tmp, /var/tmp and /dev/shm, and a dedicated uid."""
        return all(self.isolation.get(aspect) == good for aspect, good in FULL_ISOLATION.items())
