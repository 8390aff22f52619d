"""Attacks on the rollout service's `python` tool, through the real `ToolRegistry` and its sandbox
(`kuberl.common.sandbox`, real launcher and program processes): opening a socket to a server the
test listens with, writing outside its private folder, reading the service's environment, an
infinite loop, a fork bomb, a memory bomb. Each is contained and answered as tool output, and the
tool still computes ordinary code afterwards.

Programs that must leave nothing behind re-execute themselves with a unique token in their
command line, so any process of theirs that survives the call can be found in /proc.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kuberl.common.config import SandboxConfig
from kuberl.rollout import metrics as m
from kuberl.rollout.tools import ToolCall, ToolRegistry
from tests.support import REPO, escape_targets, network_probe

ROOT = os.geteuid() == 0
TIMEOUT = 3.0
CPU_SECONDS = 2
SANDBOX = SandboxConfig(
    cpu_seconds=CPU_SECONDS,
    memory_bytes=256 * 2**20,
    max_processes=16,
    max_output_bytes=64 * 1024,
    max_concurrent=1,
)
NO_ROOT = "without root the code runs as the service's uid, without a private mount namespace"


@dataclass
class Tool:
    runner: asyncio.Runner
    registry: ToolRegistry
    isolation: dict[str, str]

    def call(self, code: str) -> tuple[str, str]:
        """(text the model would see, outcome) of one python tool call."""
        return self.runner.run(self.registry.run(ToolCall("python", {"code": code})))

    def processes_of_its_uids(self) -> list[int]:
        assert self.registry.python is not None
        uids = set(self.registry.python.sandbox.uids)
        return [pid for pid, uid, state in _processes() if uid in uids and state != "Z"]


def _processes() -> Iterator[tuple[int, int, str]]:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{entry}").st_uid
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        yield int(entry), uid, state


def tagged(body: str) -> tuple[str, str]:
    """A program that runs `body` with a unique token in its command line, and the token."""
    token = f"kuberl-tool-attack-{uuid.uuid4().hex}"
    argv = f"[sys.executable, '-I', '-S', '-c', {body!r}, {token!r}]"
    return f"import os, sys\nos.execv(sys.executable, {argv})\n", token


def survivors(token: str) -> list[int]:
    """Live processes whose command line holds `token`."""
    found = []
    for pid, _, state in _processes():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read() and state != "Z":
                    found.append(pid)
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def tool() -> Iterator[Tool]:
    with asyncio.Runner() as runner:
        registry = ToolRegistry(
            ["python"], timeout_seconds=TIMEOUT, max_output_chars=4096, sandbox=SANDBOX
        )
        assert registry.python is not None
        try:
            runner.run(registry.start())
            yield Tool(runner, registry, registry.python.sandbox.isolation)
        finally:
            registry.close()


def test_the_python_tool_computes_ordinary_code(tool: Tool) -> None:
    assert tool.call("print(2+3)") == ("5", "ok")


@pytest.mark.skipif(not ROOT, reason="namespaces and a dedicated uid need root")
def test_the_python_tool_reports_full_isolation_when_run_as_root(tool: Tool) -> None:
    aspects = ("network", "files", "uid")
    gauges = {a: m.TOOL_SANDBOX_ISOLATED.labels(a)._value.get() for a in aspects}
    assert gauges == {"network": 1.0, "files": 1.0, "uid": 1.0}


def test_a_socket_to_a_listening_loopback_server_cannot_connect(tool: Tool) -> None:
    if tool.isolation["network"] != "namespace" and not ROOT:
        pytest.skip(f"no network namespace for this user: {tool.isolation.get('network_error')}")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    program = network_probe(port)
    try:
        answer = tool.call(program)
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert answer == ("blocked", "ok")


@pytest.mark.skipif(not ROOT, reason=NO_ROOT)
def test_a_file_written_outside_its_private_folder_never_appears(
    tool: Tool, tmp_path: Path
) -> None:
    targets = escape_targets(tmp_path)  # the host's /tmp among them: each call has its own
    program = (
        f"for path in {[str(t) for t in targets]!r} + ['inside.txt']:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "    except OSError:\n"
        "        pass\n"
        "print(open('inside.txt').read())\n"
    )
    answer = tool.call(program)
    assert (answer, [t for t in targets if t.exists()]) == (("x", "ok"), [])


def test_the_services_environment_cannot_be_read(tool: Tool) -> None:
    # The secret is in the initial environment of a separate "service" process (what
    # /proc/<pid>/environ shows), which runs the tool as the rollout service does.
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    program = (
        "import os\n"
        f"secret = {secret!r}.encode()\n"
        "leaks = [k for k, v in os.environb.items() if secret in v]\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        if secret in open(f'/proc/{pid}/environ', 'rb').read():\n"
        "            leaks.append(pid)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('LEAK', leaks) if leaks else print('clean')\n"
    )
    service = (
        "import asyncio, json, sys\n"
        "from kuberl.common.config import SandboxConfig\n"
        "from kuberl.rollout.tools import ToolCall, ToolRegistry\n"
        "async def main():\n"
        f"    tools = ToolRegistry(['python'], timeout_seconds={TIMEOUT}, "
        f"sandbox=SandboxConfig(max_concurrent=1, uid_base={SANDBOX.uid_base}))\n"
        "    return await tools.run(ToolCall('python', {'code': sys.argv[1]}))\n"
        "print(json.dumps(asyncio.run(main())))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", service, program],
        env={**os.environ, "ROLLOUT_TEST_SECRET": secret, "KUBERL_TEST_SECRET": secret},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == ["clean", "ok"]


@pytest.mark.parametrize(
    "body",
    ["while True:\n    pass\n", "import time\nwhile True:\n    time.sleep(0.1)\n"],
    ids=["busy", "sleeping"],
)
def test_an_infinite_loop_is_killed_at_the_timeout(tool: Tool, body: str) -> None:
    program, token = tagged(body)
    started = time.monotonic()
    text, outcome = tool.call(program)
    took = time.monotonic() - started
    assert (outcome, text.startswith("TimeoutError:"), took < TIMEOUT + 5, survivors(token)) == (
        "timeout",
        True,
        True,
        [],
    )


def test_a_fork_bomb_is_contained_and_leaves_no_process(tool: Tool) -> None:
    body = (
        "import os, time\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        time.sleep(0.01)\n"
    )
    program, token = tagged(body)
    _, outcome = tool.call(program)
    assert (outcome, survivors(token), tool.processes_of_its_uids()) == ("timeout", [], [])
    assert tool.call("print(2+3)") == ("5", "ok")


def test_a_memory_bomb_hits_the_address_space_limit(tool: Tool) -> None:
    text, outcome = tool.call("blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))")
    assert (text, outcome) == ("MemoryError", "ok")
