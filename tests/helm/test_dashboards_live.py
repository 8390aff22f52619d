"""Every Grafana panel query and every alert expression, run against a real Prometheus (Debian's
`prometheus` package) scraping a short local `kuberl run`: the supervisor starts an embedded
Redis and the five services as their own processes (`kuberl serve <service>`, the containers'
entrypoint; the trainer under torchrun), on a tiny locally built model and GSM8K prompts. A query
that returns no series fails the test: a renamed metric, a wrong label or a broken expression shows
up here, not on a user's empty dashboard.

Prometheus scrapes each process with the labels the chart's ServiceMonitor produces (`namespace`,
`pod`, `component`), and the dashboards' variables are filled in as Grafana would. Some panels
chart rare events (rejections, verifier errors and timeouts, engines dropped, failed updates); the
test provokes each once, the way a misbehaving client would, so those panels are checked too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.chart import NAMESPACE, render
from tests.helm.promql import as_series_query, is_sglang_query, panel_queries, substitute
from tests.support import REPO, SHARED_DATA

PROMETHEUS = shutil.which("prometheus")
SERVICES = ("buffer", "reward", "weight_sync", "rollout", "trainer")
DATA = SHARED_DATA / "gsm8k" / "train.jsonl"
# How long the job may take to start, and then to make every query return a series (a 2-core
# machine, shared).
START_SECONDS = 180.0
DEADLINE_SECONDS = 150.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="needs Debian's `prometheus` on PATH for a real Prometheus server (make setup "
        "fetches it into .venv/bin with tests/helm/fetch-prometheus.sh)",
    ),
]


def _missing_services() -> list[str]:
    return [s for s in SERVICES if importlib.util.find_spec(f"kuberl.{s}.server") is None]


@dataclass
class Prometheus:
    url: str

    def query(self, expr: str) -> list[dict[str, Any]]:
        params = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{params}", timeout=10) as resp:
            body = json.loads(resp.read())
        if body["status"] != "success":
            raise AssertionError(f"{expr}: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result


def _job(workdir: Path) -> Path:
    """A job `kuberl run` finishes in seconds per step: tiny model, two samples per prompt."""
    columns = {"prompt": "question", "answer": "answer"}
    job: dict[str, Any] = {
        # The probes below call as any role (an engine of their own, a stranger's lease).
        "job": {
            "name": "dashboards",
            "seed": 1,
            "run_dir": str(workdir / "runs"),
            "local": {"roles": False},
        },
        "model": {"build": {"arch": "qwen2", "size": "tiny", "tokenizer": "digits"}},
        "data": {
            "train": [{"path": str(DATA), "columns": columns, "limit": 48}],
            "eval": [{"path": str(DATA), "name": "eval", "columns": columns, "limit": 4}],
            # Epochs enough that the data never runs out before the queries are answered (10 did
            # once the lease long poll kept the trainer fed: 180 steps in 70 s, then done).
            "num_epochs": 1000,
        },
        # A small in-flight limit so backpressure happens; a filter that drops some groups.
        "buffer": {
            "max_inflight_groups": 4,
            "filters": ["tests.helm.live_plugins:drop_a_quarter"],
        },
        "reward": {
            "verifiers": {"gsm8k": 1.0},
            "custom": {"probe": {"function": "tests.helm.live_plugins:probe"}},
            "workers": 1,
            "timeout_seconds": 2.0,
        },
        "rollout": {
            "engine": {"kind": "torch", "device": "cpu", "max_batch_size": 8},
            "sampling": {"max_new_tokens": 8},
            "group_size": 2,
            "prompts_per_batch": 2,
            "batches_in_flight": 1,
            # Short enough that some held leases run out and are refused (the refusal panel).
            "lease_wait_seconds": 0.05,
        },
        "trainer": {
            "total_steps": 1000,
            "groups_per_step": 2,
            "max_staleness": -1,
            "checkpoint_every": 0,
        },
        "weight_sync": {"transports": ["gloo", "snapshot"], "heartbeat_seconds": 0.5},
    }
    path = workdir / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@dataclass
class Run:
    """A `kuberl run` in its own process group, and the ports its services announced."""

    proc: subprocess.Popen
    run_dir: Path
    log_path: Path

    def log(self) -> str:
        text = self.log_path.read_text(errors="replace")[-3000:]
        for path in sorted((self.run_dir / "logs").glob("*.log")):
            text += f"\n--- {path.name}\n" + path.read_text(errors="replace")[-1500:]
        return text

    def ports(self) -> dict[str, dict[str, int]]:
        """Process name ("buffer", "weight-sync", "rollout-0", ...) -> gRPC and metrics ports."""
        return {
            p.name.removesuffix(".ports.json"): json.loads(p.read_text())
            for p in (self.run_dir / "logs").glob("*.ports.json")
        }

    def wait_started(self, names: set[str], timeout: float) -> dict[str, dict[str, int]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kuberl run exited with {self.proc.returncode}:\n{self.log()}")
            ports = self.ports()
            # The supervisor records the trainer's endpoint once every service serves.
            endpoints = self.job().get("endpoints", {})
            if names <= set(ports) and endpoints.get("trainer") == (
                f"127.0.0.1:{ports['trainer']['port']}"
            ):
                return ports
            time.sleep(0.5)
        raise TimeoutError(f"kuberl run did not start {sorted(names)} in {timeout}s:\n{self.log()}")

    def job(self) -> dict[str, Any]:
        """The run's job file, as the services read it."""
        try:
            data = yaml.safe_load((self.run_dir / "job.yaml").read_text())
        except (OSError, yaml.YAMLError):
            return {}
        return data if isinstance(data, dict) else {}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the supervisor drains and stops everything
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _start_prometheus(workdir: Path, metrics_ports: dict[str, int]) -> tuple[subprocess.Popen, str]:
    from kuberl.common.redis_server import free_port

    assert PROMETHEUS is not None
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "kuberl",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{port}"],
                        # What the chart's ServiceMonitor attaches to every series.
                        "labels": {
                            "namespace": NAMESPACE,
                            "component": name.rsplit("-", 1)[0] if name[-1].isdigit() else name,
                            "pod": f"rl-kuberl-{name}",
                        },
                    }
                    for name, port in metrics_ports.items()
                ],
            }
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (workdir / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(
                f"prometheus did not start: {(workdir / 'prometheus.log').read_text()}"
            )
        time.sleep(0.2)


def _provoke_rare_events(ports: dict[str, dict[str, int]]) -> None:
    """What a misbehaving client or engine does, once each, so that the panels of rare events
    (rejections, verifier errors and timeouts, engines dropped, failed updates) have a series."""
    import grpc

    from kuberl.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
    from kuberl.api.reward.v1 import reward_pb2, reward_pb2_grpc
    from kuberl.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
    from kuberl.api.weight_sync.v1 import weight_sync_pb2 as ws
    from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as ws_grpc
    from kuberl.common.channels import sync_channel

    def address(service: str) -> str:
        return f"127.0.0.1:{ports[service]['port']}"

    def refused(call, request) -> None:
        with pytest.raises(grpc.RpcError):
            call(request, timeout=30)

    with sync_channel(address("buffer")) as channel:
        buffer = buffer_pb2_grpc.BufferServiceStub(channel)
        refused(buffer.LeasePrompts, buffer_pb2.LeasePromptsRequest(max_prompts=0, consumer="p"))
    with sync_channel(address("reward")) as channel:
        reward = reward_pb2_grpc.RewardServiceStub(channel)
        unknown = reward_pb2.Sample(sample_id="unknown", response="42", verifiers=["no-such"])
        refused(reward.Score, reward_pb2.ScoreRequest(samples=[unknown]))
        broken = [
            reward_pb2.Sample(sample_id=kind, response=kind, verifiers=["probe"])
            for kind in ("raise", "hang")
        ]
        reward.Score(reward_pb2.ScoreRequest(samples=broken), timeout=60)
    with sync_channel(address("rollout-0")) as channel:
        rollout = rollout_pb2_grpc.RolloutServiceStub(channel)
        refused(rollout.Drain, rollout_pb2.DrainRequest(timeout_seconds=-1))
    with sync_channel(address("weight-sync")) as channel:
        weights = ws_grpc.WeightSyncServiceStub(channel)
        # An engine that fails its update, then goes silent and is dropped.
        engine = ws.EngineInfo(engine_id="probe-engine", transports=[ws.TRANSPORT_SNAPSHOT])
        weights.RegisterEngine(ws.RegisterEngineRequest(engine=engine), timeout=30)
        failed = ws.ReportLoadedRequest(
            engine_id="probe-engine", version=1, ok=False, error="probe"
        )
        weights.ReportLoaded(failed, timeout=30)
        refused(weights.ReportLoaded, ws.ReportLoadedRequest(engine_id="nobody", version=1))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, Run]]:
    missing = _missing_services()
    if missing:
        pytest.skip(
            f"services not implemented yet: {', '.join(missing)} (no kuberl.<service>.server)"
        )
    if importlib.util.find_spec("kuberl.local.supervisor") is None:
        pytest.skip("`kuberl run` (kuberl.local.supervisor) not implemented yet")
    workdir = tmp_path_factory.mktemp("live")
    job_file = _job(workdir)
    log_path = workdir / "kuberl-run.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kuberl.cli", "run", "--plain", "--rollout-replicas", "1",
             "--max-restarts", "0", "--run-dir", str(workdir / "run"), str(job_file)],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    run = Run(proc, workdir / "run", log_path)
    prometheus: subprocess.Popen | None = None
    try:
        names = {"buffer", "reward", "weight-sync", "rollout-0", "trainer"}
        ports = run.wait_started(names, START_SECONDS)
        prometheus, url = _start_prometheus(
            workdir, {name: ports[name]["metrics_port"] for name in names}
        )
        _provoke_rare_events(ports)
        yield Prometheus(url), run
    finally:
        run.stop()
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(10)


def _queries() -> list[tuple[str, str]]:
    """(what, PromQL) of every dashboard panel target and every alert expression."""
    # SGLang's panels are left out: no SGLang runs here (it needs a GPU). test_dashboards.py
    # checks their names against SGLang's source and their PromQL with promtool.
    found = [
        (f"dashboard {board} / {title}", substitute(expr, NAMESPACE))
        for board, title, expr in panel_queries()
        if not is_sglang_query(expr)
    ]
    rule = render("monitoring").all("PrometheusRule")[0]
    found += [
        (f"alert {r['alert']}", as_series_query(r["expr"]))
        for group in rule["spec"]["groups"]
        for r in group["rules"]
    ]
    return found


def test_every_panel_and_alert_query_returns_series(job) -> None:
    prometheus, run = job
    queries = _queries()
    empty = set(range(len(queries)))
    deadline = time.monotonic() + DEADLINE_SECONDS
    while empty and time.monotonic() < deadline:
        assert run.proc.poll() is None, f"kuberl run exited early:\n{run.log()}"
        empty = {i for i in empty if not prometheus.query(queries[i][1])}
        if empty:
            time.sleep(2)
    no_series = sorted(f"{queries[i][0]}: {queries[i][1]}" for i in empty)
    assert not no_series, "queries without a series:\n" + "\n".join(no_series) + "\n" + run.log()
