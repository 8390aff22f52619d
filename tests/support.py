"""Helpers for tests that run real kuberl processes: start a server in a subprocess, find its
ports, wait for health, stop it, and show its log when something fails."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
# The shared data folder that sits beside the project (GSM8K train/test).
SHARED_DATA = REPO.parent / "shared" / "data"
GSM8K_TRAIN = SHARED_DATA / "gsm8k" / "train.jsonl"
GSM8K_TEST = SHARED_DATA / "gsm8k" / "test.jsonl"


class ServiceProcess:
    """A server process started with `--port-file`; `address` is host:port once it listens."""

    def __init__(
        self, args: list[str], workdir: Path, name: str, env: dict[str, str] | None = None
    ):
        self.name = name
        self.port_file = workdir / f"{name}.ports.json"
        self.log_path = workdir / f"{name}.log"
        self.port_file.unlink(missing_ok=True)
        self._log = self.log_path.open("wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [*args, "--port-file", str(self.port_file)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=REPO,
            start_new_session=True,
        )
        self.port = 0
        self.metrics_port = 0

    @classmethod
    def kuberl(
        cls,
        service: str,
        config: Path,
        workdir: Path,
        name: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ServiceProcess:
        """`kuberl serve <service> --config <config>` in a subprocess."""
        args = [sys.executable, "-m", "kuberl.cli", "serve", service, "--config", str(config)]
        return cls(args, workdir, name or service, env)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_listening(self, timeout: float = 60.0) -> ServiceProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            if self.port_file.exists():
                ports = json.loads(self.port_file.read_text())
                self.port, self.metrics_port = ports["port"], ports["metrics_port"]
                return self
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} did not listen within {timeout}s:\n{self.log()}")

    def wait_serving(self, timeout: float = 60.0) -> ServiceProcess:
        from kuberl.common.channels import wait_serving

        self.wait_listening(timeout)
        wait_serving(self.address, timeout)
        return self

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, wait, SIGKILL the process group if it does not exit; return its exit code."""
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.stop()
        else:
            self._log.close()


def network_probe(port: int) -> str:
    """Python source for a sandboxed program that tries to connect to a loopback port (a server
    the test listens on) and two outside addresses; it prints `blocked` or `reached [hosts]`."""
    return (
        "import socket\n"
        "reached = []\n"
        f"for host, port in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=1).close()\n"
        "        reached.append(host)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('reached', reached) if reached else print('blocked')\n"
    )


def escape_targets(tmp_path: Path) -> list[Path]:
    """Files a sandboxed program must not be able to create: in the test's own folder (made
    world-writable, so only the sandbox's isolation stops it), in the repository, and in the
    host's /tmp."""
    tmp_path.chmod(0o777)
    return [
        tmp_path / "escaped.txt",
        REPO / f"escaped-{uuid.uuid4().hex}.txt",
        Path("/tmp") / f"kuberl-escaped-{uuid.uuid4().hex}.txt",
    ]


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (Linux: /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def scratch_shm_dir(prefix: str) -> str:
    """A fresh /dev/shm folder name for a test's weight-sync `shm_dir`, removed when this test
    process exits (a service leaves the folder itself behind: hundreds piled up per run)."""
    path = f"/dev/shm/{prefix}-{uuid.uuid4().hex[:8]}"
    atexit.register(shutil.rmtree, path, True)
    return path


def short_demo_job(
    tmp: Path, name: str, *, eval_prompts: int = 8, max_inflight_groups: int = 8, **trainer: Any
) -> Path:
    """examples/demo.yaml cut down for a whole local run in a test (the demo's model, data and
    services): groups of 4, 4 prompts a rollout batch and 4 groups a step, `eval_prompts` eval
    prompts, rounds at the start and the end only, no warm start; `trainer` sets the rest of the
    trainer section (total_steps, checkpoint_every, ...). Written to tmp/job.yaml."""
    doc = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    doc["job"]["name"] = name
    doc["job"]["run_dir"] = str(tmp / "runs")
    doc["data"]["eval"][0]["limit"] = eval_prompts
    doc["rollout"]["group_size"] = 4
    doc["rollout"]["prompts_per_batch"] = 4
    doc["rollout"]["sampling"]["max_new_tokens"] = 4
    doc["rollout"]["drain_seconds"] = 5
    doc["buffer"]["max_inflight_groups"] = max_inflight_groups
    doc["trainer"].update(
        {"groups_per_step": 4, "eval_every": 0, "sft_steps": 0, "batch_wait_seconds": 5, **trainer}
    )
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path
