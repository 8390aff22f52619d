"""Two Linux network namespaces joined by a veth pair, for tests that cut the network between
kuberl services (`tests/reliability/test_network_partition.py`).

`Link.create()` makes two namespaces of the test's own (`kuberl-<pid>-<random>-a` / `-b`, so
parallel test processes never collide), a veth pair with one end in each (`10.77.0.1` in `a`,
`10.77.0.2` in `b`; the addresses are private to the two namespaces, so every pair may use the
same ones) and loopback up in both. `Link.argv(ns, argv)` wraps a command so that it runs inside
a namespace (`ip netns exec`, which execs in place: the pid is the program's). `cut()` takes the
`a` end down: `b` then sees NO-CARRIER and every packet between the two is dropped silently, as
in a partition (no RST, no ICMP: open TCP connections hang until a deadline or keepalive says
otherwise); `restore()` brings it back. `delete()` kills whatever still runs in the namespaces
and removes them; it is safe to call twice.

`Link.create()` raises `NamespacesUnavailable` with the reason when this host cannot do it (not
root, no `ip`, the kernel refuses a namespace or veth): it tries for real instead of guessing.

Run as `python -m tests.reliability.netns proxy SOCKET HOST PORT` (inside a namespace) it is a
byte-for-byte forwarder from a Unix socket to HOST:PORT: Unix sockets live in the file system,
not in a network namespace, so the test process reaches a server inside the namespace through
one without adding any interface to its own namespace. Only the standard library is imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

A_ADDR = "10.77.0.1"
B_ADDR = "10.77.0.2"
DEVICE = "kr0"  # the veth end's name inside each namespace
PREFIX = "kuberl-"
_OURS = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+-[ab]$")


class NamespacesUnavailable(RuntimeError):
    """This host cannot make network namespaces or veth pairs; the message says why."""


def _ip(*args: str, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)


def _checked(*args: str) -> None:
    done = _ip(*args)
    if done.returncode != 0:
        raise NamespacesUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def _pids(ns: str) -> list[int]:
    done = _ip("netns", "pids", ns)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _delete_namespace(ns: str) -> None:
    """SIGKILL every process left in ns (they are this test's), then remove ns."""
    for _ in range(50):
        pids = _pids(ns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    _ip("netns", "delete", ns)


def sweep_orphans() -> list[str]:
    """Remove namespaces of this module whose creating process is gone (a test run that was
    SIGKILLed before its teardown); returns their names."""
    done = _ip("netns", "list")
    removed = []
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _OURS.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _delete_namespace(name)
            removed.append(name)
    return removed


@dataclass
class Link:
    """Namespaces `a` and `b` joined by a veth pair (`A_ADDR` in a, `B_ADDR` in b)."""

    a: str
    b: str
    is_cut: bool = False
    deleted: bool = False

    @classmethod
    def create(cls) -> Link:
        if shutil.which("ip") is None:
            raise NamespacesUnavailable("no `ip` command (iproute2) on PATH")
        sweep_orphans()
        tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        link = cls(a=f"{tag}-a", b=f"{tag}-b")
        made: list[str] = []
        try:
            for ns in (link.a, link.b):
                _checked("netns", "add", ns)
                made.append(ns)
            # Both ends are created inside their namespaces: nothing appears in ours.
            _checked(
                "link", "add", DEVICE, "netns", link.a, "type", "veth",
                "peer", "name", DEVICE, "netns", link.b,
            )  # fmt: skip
            for ns, addr in ((link.a, A_ADDR), (link.b, B_ADDR)):
                _checked("-n", ns, "addr", "add", f"{addr}/24", "dev", DEVICE)
                _checked("-n", ns, "link", "set", "lo", "up")
                _checked("-n", ns, "link", "set", DEVICE, "up")
        except (NamespacesUnavailable, OSError, subprocess.SubprocessError) as exc:
            for ns in made:
                _delete_namespace(ns)
            if isinstance(exc, NamespacesUnavailable):
                raise
            raise NamespacesUnavailable(f"running `ip` failed: {exc}") from exc
        return link

    def argv(self, ns: str, argv: list[str]) -> list[str]:
        """argv run inside namespace ns."""
        return ["ip", "netns", "exec", ns, *argv]

    def cut(self) -> None:
        """Drop every packet between the namespaces (the `a` end goes down)."""
        _checked("-n", self.a, "link", "set", DEVICE, "down")
        self.is_cut = True

    def restore(self) -> None:
        _checked("-n", self.a, "link", "set", DEVICE, "up")
        self.is_cut = False

    def delete(self) -> None:
        if self.deleted:
            return
        self.deleted = True
        for ns in (self.a, self.b):
            _delete_namespace(ns)

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()


# -- the Unix socket forwarder ---------------------------------------------------------------


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _forward(path: str, host: str, port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_unix_server(handle, path)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[0] != "proxy":
        print("usage: python -m tests.reliability.netns proxy SOCKET HOST PORT", file=sys.stderr)
        return 2
    _, path, host, port = argv
    asyncio.run(_forward(path, host, int(port)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
