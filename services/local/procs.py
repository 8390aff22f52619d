"""Child processes of the local supervisor: start, wait until ready, restart with a limit, stop.

`kuberl run` (`kuberl.local.supervisor`) describes every service as a `ProcessSpec` (the
container's command line, `kuberl serve <service>`, plus environment overrides) and hands it to a
`ProcessGroup`, which starts each in its own session with its log in `<log_dir>/<name>.log`,
waits for its port file and gRPC SERVING, restarts one that exits on the same port up to
`max_restarts` times (`ServiceFailed` past that, with its log's last lines), and stops them all
in reverse order, SIGTERM then SIGKILL. Nothing here knows about kuberl's services: the unit
tests drive it with small dummy commands.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from kuberl.common.childproc import die_with_parent
from kuberl.common.logs import get_logger

log = get_logger(__name__)


@dataclass
class ProcessSpec:
    """One supervised process.

    Args:
        name: unique name; also the log file's stem (`<name>.log`).
        argv: the command line.
        env: variables added to the supervisor's environment.
        cwd: working directory (default: the supervisor's).
        port_file: append `--port-file <log_dir>/<name>.ports.json` and wait for it: the
            process writes `{"port": ..., "metrics_port": ...}` there once listening.
        health: once listening, wait until gRPC health says SERVING on the port.
        max_restarts: how many times a process that exits unexpectedly is started again.
        exits_when_done: exit code 0 means the process finished its work (not a crash).
        port_env: variable that pins the gRPC port on a restart (the first start binds a free
            one), e.g. `KUBERL_BUFFER__SERVER__PORT`.
        start_timeout: seconds to become ready before the start counts as failed.
        unset: variables of the supervisor's environment the process must not inherit.
    """

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    port_file: bool = True
    health: bool = True
    max_restarts: int = 0
    exits_when_done: bool = False
    port_env: str | None = None
    start_timeout: float = 180.0
    unset: tuple[str, ...] = ()


class ServiceFailed(RuntimeError):
    """A supervised process exited (or never became ready) and may not be restarted again."""

    def __init__(self, name: str, reason: str, log_path: Path, log_tail: str) -> None:
        self.name = name
        self.reason = reason
        self.log_path = log_path
        self.log_tail = log_tail
        super().__init__(f"{name} {reason}; last lines of {log_path}:\n{log_tail or '<empty log>'}")


class StopRequested(RuntimeError):
    """Waiting was abandoned because the supervisor is shutting down."""


def tail_lines(path: Path, lines: int = 30, max_bytes: int = 64 * 1024) -> str:
    """The last `lines` lines of a text file (reading at most its last max_bytes)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    text = data.decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) of every process (Linux /proc)."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        table[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(root: int, table: dict[int, tuple[int, int]] | None = None) -> dict[int, int]:
    """Every descendant of root (not root itself): pid -> start time."""
    table = _process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, int] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in out:
            out[pid] = table[pid][1]
            todo += children.get(pid, [])
    return out


def _alive(pid: int, start: int, table: dict[int, tuple[int, int]]) -> bool:
    """The same process (pid and start time) still exists, not a zombie we could wait for."""
    return pid in table and table[pid][1] == start


class ManagedProcess:
    """A running (or finished) instance of a `ProcessSpec`, restartable in place.

    It remembers every descendant it has seen (`tree`, refreshed on every check) and signals and
    sweeps them too, even once re-parented away: torchrun starts each worker in a session of its
    own, which a signal to torchrun's process group alone would not reach.
    """

    def __init__(self, spec: ProcessSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        self.port_path = log_dir / f"{spec.name}.ports.json"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.port = 0
        self.metrics_port = 0
        self.ready_seconds: float | None = None  # time from (last) start to ready
        self.reached_serving = False
        self.finished = False  # exits_when_done and exited 0
        self.exit_codes: list[int] = []  # every exit, in order (crashes, finish, final stop)
        self._exit_recorded = False
        self._log: IO[bytes] | None = None
        self._started_at = 0.0
        self.tree: dict[int, int] = {}  # descendants seen (pid -> start time), kept until gone

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def restarts(self) -> int:
        return max(0, self.starts - 1)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        """Start (or restart) the process; returns at once (see `wait_ready`). Its own session
        keeps a terminal's Ctrl-C for the supervisor alone; the parent-death signal keeps a
        SIGKILLed supervisor from leaving services behind."""
        env = {k: v for k, v in os.environ.items() if k not in self.spec.unset}
        env.update({"PYTHONUNBUFFERED": "1", **self.spec.env})
        if self.starts and self.spec.port_env and self.port:
            env[self.spec.port_env] = str(self.port)
        argv = list(self.spec.argv)
        if self.spec.port_file:
            self.port_path.unlink(missing_ok=True)
            argv += ["--port-file", str(self.port_path)]
        if self._log is None:
            self._log = self.log_path.open("ab")
        self._log.write(
            f"# kuberl run: start {self.starts + 1} of {self.name}: {' '.join(argv)}\n".encode()
        )
        self._log.flush()
        self.proc = subprocess.Popen(
            die_with_parent(argv, signal.SIGTERM),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.spec.cwd,
            start_new_session=True,
        )
        self.starts += 1
        self._exit_recorded = False
        self._started_at = time.monotonic()
        log.info("process.started", name=self.name, pid=self.proc.pid, start=self.starts)

    def poll(self) -> int | None:
        """The exit code if the process has exited, else None."""
        return None if self.proc is None else self.proc.poll()

    def record_exit(self) -> int | None:
        """Note the exit code of the current start in `exit_codes` (once); return it."""
        code = self.poll()
        if code is not None and not self._exit_recorded:
            self.exit_codes.append(code)
            self._exit_recorded = True
        return code

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Block until listening (port file) and SERVING; ServiceFailed at once if it exits, or
        when it times out."""
        from kuberl.common.channels import health_status, sync_channel

        deadline = self._started_at + self.spec.start_timeout
        status = "not listening"
        channel = None
        try:
            while True:
                if should_stop():
                    raise StopRequested(f"stopped while waiting for {self.name}")
                code = self.poll()
                if code == 0 and self.spec.exits_when_done:
                    self.finished = True  # done before we saw it serving
                    self.record_exit()
                    return
                if code is not None:
                    raise self._failure(f"exited with code {code} while starting")
                if time.monotonic() > deadline:
                    raise self._failure(
                        f"not ready after {self.spec.start_timeout:.0f}s (last status: {status})"
                    )
                if self.spec.port_file and not self.port_path.exists():
                    time.sleep(0.05)
                    continue
                if self.spec.port_file and channel is None:
                    ports = json.loads(self.port_path.read_text())
                    self.port = int(ports["port"])
                    self.metrics_port = int(ports.get("metrics_port", 0))
                    if not self.spec.health:
                        break
                    channel = sync_channel(self.address)
                if not self.spec.port_file or channel is None:
                    break
                status = health_status(channel, timeout=1.0)
                if status == "SERVING":
                    self.reached_serving = True
                    break
                time.sleep(0.1)
        finally:
            if channel is not None:
                channel.close()
        self.ready_seconds = time.monotonic() - self._started_at
        log.info("process.ready", name=self.name, port=self.port, seconds=self.ready_seconds)

    def _failure(self, reason: str) -> ServiceFailed:
        if self._log is not None:
            self._log.flush()
        return ServiceFailed(self.name, reason, self.log_path, tail_lines(self.log_path))

    def refresh_tree(self, table: dict[int, tuple[int, int]] | None = None) -> None:
        """Remember the process's current descendants; forget the ones that are gone."""
        table = _process_table() if table is None else table
        # A new dict, never one updated in place: the supervisor's second-Ctrl-C handler runs
        # this between two bytecodes of a loop over the old one.
        tree = dict(self.tree)
        if self.running() and self.proc is not None:
            tree.update(descendants(self.proc.pid, table))
        self.tree = {p: t for p, t in tree.items() if _alive(p, t, table)}

    def signal(self, sig: int) -> None:
        """Send sig to the process group; SIGKILL also to every descendant seen, wherever it
        lives. A graceful signal goes through the group's processes only: torchrun forwards
        SIGTERM to its workers itself, and a worker must not get it twice."""
        if self.proc is None:
            return
        table = _process_table()
        self.refresh_tree(table)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
        if sig != signal.SIGKILL:
            return
        for pid in list(self.tree):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM, wait up to grace, then SIGKILL; always sweep the group; return the code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("process.kill", name=self.name, after_seconds=grace)
                self.signal(signal.SIGKILL)
                self.proc.wait()
        # Children that outlived their leader: in the group, or (torchrun workers) in the tree.
        self.signal(signal.SIGKILL)
        self._wait_group_gone()
        self.close_log()
        return self.record_exit()

    def group_alive(self) -> bool:
        """True while any process of the group or of the tree seen exists (zombies included)."""
        if self.proc is None:
            return False
        if self.tree:
            self.refresh_tree()
            if self.tree:
                return True
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _wait_group_gone(self, timeout: float = 5.0) -> None:
        # Killed children are reparented and reaped by init a moment later.
        deadline = time.monotonic() + timeout
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class ProcessGroup:
    """The supervisor's processes, in start order: start, check, restart, stop them all."""

    def __init__(self, log_dir: Path, should_stop: Callable[[], bool] = lambda: False) -> None:
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.should_stop = should_stop
        self.processes: dict[str, ManagedProcess] = {}

    def __getitem__(self, name: str) -> ManagedProcess:
        return self.processes[name]

    def start(self, spec: ProcessSpec, *, wait: bool = True) -> ManagedProcess:
        """Start a new process; with wait, block until ready (restarting within its limit)."""
        if spec.name in self.processes:
            raise ValueError(f"a process named {spec.name!r} is already supervised")
        proc = ManagedProcess(spec, self.log_dir)
        self.processes[spec.name] = proc
        proc.start()
        if wait:
            self._wait_ready_or_retry(proc)
        return proc

    def wait_ready(self, name: str) -> None:
        self._wait_ready_or_retry(self.processes[name])

    def _wait_ready_or_retry(self, proc: ManagedProcess) -> None:
        while True:
            try:
                proc.wait_ready(self.should_stop)
                return
            except ServiceFailed as failure:
                if proc.poll() is None:  # timed out while running: it will not come up
                    proc.stop(grace=5.0)
                proc.record_exit()
                if proc.restarts >= proc.spec.max_restarts:
                    raise
                log.warning("process.restart", name=proc.name, reason=failure.reason)
                proc.start()

    def check(self) -> list[str]:
        """Restart processes that exited unexpectedly; return the names that finished cleanly.

        Raises ServiceFailed when a process exits past its restart limit.
        """
        finished = []
        table = _process_table()
        for proc in self.processes.values():
            proc.refresh_tree(table)
        for proc in self.processes.values():
            if proc.finished:
                continue
            code = proc.poll()
            if code is None:
                continue
            proc.record_exit()
            if proc.spec.exits_when_done and code == 0:
                proc.finished = True
                log.info("process.finished", name=proc.name)
                finished.append(proc.name)
                continue
            failure = proc._failure(f"exited with code {code}")
            if proc.restarts >= proc.spec.max_restarts:
                log.error("process.failed", name=proc.name, code=code, restarts=proc.restarts)
                raise failure
            log.warning("process.restart", name=proc.name, code=code, restarts=proc.restarts)
            proc.stop(grace=1.0)  # sweep leftovers of the dead process's group
            proc.start()
            self._wait_ready_or_retry(proc)
        return finished

    def stop_all(
        self, grace: float = 15.0, order: list[str] | None = None
    ) -> dict[str, int | None]:
        """Stop every process (reverse start order unless `order` is given); return exit codes."""
        names = list(order or reversed(self.processes))
        names += [n for n in reversed(self.processes) if n not in names]
        codes = {}
        for name in names:
            codes[name] = self.processes[name].stop(grace)
            log.info("process.stopped", name=name, code=codes[name])
        return codes
