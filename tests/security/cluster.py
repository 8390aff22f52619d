"""All five kuberl services as real processes (`kuberl serve <service>`), talking mutual TLS.

One job on an embedded Redis that requires a password (given to the buffer only through
`redis.password_env`, never in the job file), a tiny Qwen2 built locally, and a `tls` section with
`require_client_cert`: certificates come from a CA the tests make (tests/security/certs.py). The
rollout replica runs in eval mode, so it generates only what an evaluation round asks for and
otherwise idles: at start the trainer queues eval round 0, the replica leases its two prompts,
generates, has them scored by reward and puts the groups back, and the trainer reads them — every
hop over mutual TLS — then waits for training groups that never come. The fuzzers and the TLS
tests then hit these processes; none of them may die.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kuberl.common.channels import sync_channel, wait_serving
from kuberl.common.config import TLSConfig
from kuberl.common.redis_server import EmbeddedRedis
from tests.security.certs import Authority, Pair, authority
from tests.support import ServiceProcess

SERVICES = ("buffer", "reward", "weight_sync", "rollout", "trainer")
REDIS_PASSWORD_ENV = "KUBERL_TEST_REDIS_PASSWORD"
GROUP_SIZE = 2
TRAIN_PROMPTS = 8
#: Every server's message limit here (production default: 256 MiB), so that an oversized
#: request is cheap to send; weight snapshots travel in 4 MiB chunks, well below it.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024


#: One read per service that touches its state (Redis for the buffer): path, request bytes.
PROBES = {
    "buffer": ("/kuberl.buffer.v1.BufferService/GetStats", b""),
    "reward": ("/kuberl.reward.v1.RewardService/ListVerifiers", b""),
    "weight_sync": ("/kuberl.weight_sync.v1.WeightSyncService/GetStatus", b""),
    "rollout": ("/kuberl.rollout.v1.RolloutService/GetStatus", b""),
    "trainer": ("/kuberl.trainer.v1.TrainerService/GetStatus", b""),
}


@dataclass
class Cluster:
    folder: Path
    ca: Authority
    rogue: Authority
    client: Pair
    redis: EmbeddedRedis
    job: Path
    procs: dict[str, ServiceProcess] = field(default_factory=dict)

    @property
    def client_tls(self) -> TLSConfig:
        """What a legitimate caller uses: the job's CA and a client certificate it signed."""
        return TLSConfig(
            enabled=True,
            ca_file=str(self.ca.cert),
            cert_file=str(self.client.cert),
            key_file=str(self.client.key),
        )

    def address(self, service: str) -> str:
        return self.procs[service].address

    def channel(self, service: str) -> Any:
        return sync_channel(self.address(service), tls=self.client_tls)

    def metrics(self, service: str) -> str:
        url = f"http://127.0.0.1:{self.procs[service].metrics_port}/metrics"
        return str(urllib.request.urlopen(url, timeout=10).read().decode())

    def alive(self) -> dict[str, int | None]:
        """Exit code of every service process (None while it runs)."""
        return {name: proc.proc.poll() for name, proc in self.procs.items()}

    def assert_healthy(self) -> None:
        """Every service process still runs, says SERVING, and answers its basic read (so state
        that a hostile request corrupted shows up here, not only in the request's answer)."""
        from kuberl.common.channels import health_status

        assert self.alive() == dict.fromkeys(self.procs), self.logs()
        status = {}
        for name in self.procs:
            with self.channel(name) as channel:
                status[name] = health_status(channel, timeout=10)
                path, request = PROBES[name]
                try:
                    channel.unary_unary(path)(request, timeout=10)
                except Exception as exc:
                    status[name] = f"{path}: {exc}"
        assert set(status.values()) == {"SERVING"}, (status, self.logs())

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{p.log()[-2500:]}" for n, p in self.procs.items())


def _dataset(path: Path, n: int, offset: int = 0) -> str:
    rows = [
        {"question": f"What is {i} plus {i}?", "answer": f"#### {2 * i}"}
        for i in range(offset, offset + n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def job_document(folder: Path, redis_url: str, model: Path, ca: Authority, server: Pair) -> dict:
    local = {
        "host": "127.0.0.1",
        "port": 0,
        "metrics_port": 0,
        "max_message_bytes": MAX_MESSAGE_BYTES,
    }
    return {
        "job": {"name": f"sec{uuid.uuid4().hex[:8]}", "seed": 5},
        "redis": {
            "url": redis_url,
            "password_env": REDIS_PASSWORD_ENV,
            "connect_timeout_seconds": 20,
        },
        "tls": {
            "enabled": True,
            "ca_file": str(ca.cert),
            "cert_file": str(server.cert),
            "key_file": str(server.key),
            "require_client_cert": True,
        },
        "model": {"path": str(model)},
        "data": {
            "train": [
                {
                    "path": _dataset(folder / "train.jsonl", TRAIN_PROMPTS),
                    "columns": {"prompt": "question"},
                }
            ],
            "eval": [
                {
                    "path": _dataset(folder / "eval.jsonl", 2, offset=100),
                    "columns": {"prompt": "question"},
                }
            ],
        },
        "buffer": {
            "server": local,
            "lease_timeout_seconds": 30,
            "batch_ack_timeout_seconds": 60,
            "max_inflight_groups": 1000,
        },
        "reward": {"server": local, "workers": 1, "verifiers": {"gsm8k": 1.0}},
        "rollout": {
            "server": local,
            "mode": "eval",
            "group_size": GROUP_SIZE,
            "prompts_per_batch": 2,
            "batches_in_flight": 1,
            "sampling": {"max_new_tokens": 6, "temperature": 1.0},
            "engine": {"kind": "torch", "num_threads": 1},
            "idle_poll_seconds": 0.5,
            "retry_initial_seconds": 0.05,
            "catch_up_seconds": 120,
            "drain_seconds": 2,
        },
        "trainer": {
            "server": local,
            "mode": "rl",
            "total_steps": 1000,
            "groups_per_step": 2,
            "micro_batch_tokens": 64,
            "batch_wait_seconds": 2.0,
            "checkpoint_every": 0,
            "checkpoint_dir": str(folder / "checkpoints"),
            "export_hf": False,
            "resume": False,
            "eval_timeout_seconds": 120,
        },
        "weight_sync": {
            "server": local,
            "snapshot_dir": str(folder / "snapshots"),
            "shm_dir": str(folder / "shm"),
            "heartbeat_seconds": 1.0,
        },
    }


def start_cluster(folder: Path, timeout: float = 240.0) -> Cluster:
    """Start Redis and the five services; return once all say SERVING (over mutual TLS)."""
    from kuberl.common.modelbuild import build_model

    folder.mkdir(parents=True, exist_ok=True)
    ca = authority(folder / "pki", "ca")
    rogue = authority(folder / "pki", "rogue")
    server, client = ca.issue("services"), ca.issue("client")
    password = uuid.uuid4().hex
    redis = EmbeddedRedis(folder / "redis", password=password, die_with_parent=True)
    redis.start()
    model = build_model(folder / "model", arch="qwen2", size="tiny", tokenizer="digits", seed=0)
    url = f"redis://{redis.host}:{redis.port}/0"  # no password here: it comes from the env
    doc = job_document(folder, url, model, ca, server)
    first = folder / "job-first.yaml"
    first.write_text(yaml.safe_dump(doc))
    cluster = Cluster(folder, ca, rogue, client, redis, first)
    env = {REDIS_PASSWORD_ENV: password, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        for name in ("buffer", "reward", "weight_sync"):
            cluster.procs[name] = ServiceProcess.kuberl(name, first, folder, env=env)
        for name in ("buffer", "reward", "weight_sync"):
            cluster.procs[name].wait_listening(timeout)
        doc["endpoints"] = {
            "buffer": cluster.address("buffer"),
            "reward": cluster.address("reward"),
            "weight_sync": cluster.address("weight_sync"),
            "trainer": "127.0.0.1:1",
        }
        second = folder / "job.yaml"
        second.write_text(yaml.safe_dump(doc))
        cluster.job = second
        for name in ("rollout", "trainer"):
            cluster.procs[name] = ServiceProcess.kuberl(name, second, folder, env=env)
        deadline = time.monotonic() + timeout
        for name in SERVICES:
            proc = cluster.procs[name].wait_listening(max(1.0, deadline - time.monotonic()))
            wait_serving(
                proc.address, max(1.0, deadline - time.monotonic()), tls=cluster.client_tls
            )
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def stop_cluster(cluster: Cluster) -> None:
    for proc in reversed(list(cluster.procs.values())):
        proc.stop()
    cluster.redis.stop()


def wait_for(condition: Any, timeout: float, what: str, cluster: Cluster) -> Any:
    """Poll condition() until it returns something truthy; fail with the services' logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n{cluster.logs()}")
