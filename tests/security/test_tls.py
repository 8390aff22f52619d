"""TLS and mutual TLS between kuberl services, with certificates the tests make themselves.

The five services of tests/security/cluster run with `tls.require_client_cert`: they reach each
other over mutual TLS (an evaluation round goes rollout -> reward -> buffer -> trainer, the
replica registers with weight-sync), and each refuses a plaintext client, a TLS client without
a certificate, and one whose certificate another CA signed; a client that does not trust the
job's CA refuses the server. A weight-sync started with server-only TLS takes TLS clients
without certificates, and serves a rotated certificate to new connections without a restart.
`kuberl health` reads its TLS settings from the `KUBERL_TLS__*` variables the services also use.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kuberl.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from kuberl.api.weight_sync.v1 import weight_sync_pb2 as wpb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc
from kuberl.common.channels import sync_channel
from kuberl.common.config import TLSConfig
from tests.security.certs import authority
from tests.security.cluster import SERVICES, Cluster, wait_for
from tests.support import ServiceProcess


def _check(address: str, tls: TLSConfig) -> tuple[grpc.StatusCode, str]:
    with sync_channel(address, tls=tls) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_the_services_reach_each_other_over_mutual_tls(cluster: Cluster) -> None:
    def eval_metrics() -> dict[str, float]:
        with cluster.channel("trainer") as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            status = stub.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
        return {k: v for k, v in status.metrics.items() if k.startswith("eval/")}

    metrics = wait_for(eval_metrics, 120, "the trainer's first evaluation round", cluster)
    with cluster.channel("weight_sync") as channel:
        stub = weight_sync_pb2_grpc.WeightSyncServiceStub(channel)
        engines = stub.GetStatus(wpb.GetStatusRequest(), timeout=10).engines
    logs = {name: proc.log_path.read_text() for name, proc in cluster.procs.items()}
    # The start-of-job evaluation round: the replica generated, reward scored, the buffer kept
    # the groups and the trainer read both of them back.
    assert (metrics["eval/groups"], metrics["eval/missing_groups"]) == (2.0, 0.0)
    assert len(engines) >= 1
    assert all("tls=mutual" in text for text in logs.values())
    assert "unreachable" not in logs["trainer"] and "heartbeat_failed" not in logs["rollout"]


@pytest.mark.parametrize("service", SERVICES)
def test_a_client_with_a_certificate_of_the_jobs_ca_is_served(
    cluster: Cluster, service: str
) -> None:
    assert _check(cluster.address(service), cluster.client_tls) == (grpc.StatusCode.OK, "")


@pytest.mark.parametrize("service", SERVICES)
def test_a_plaintext_client_is_refused(cluster: Cluster, service: str) -> None:
    code, _ = _check(cluster.address(service), TLSConfig())
    assert code is grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("service", SERVICES)
def test_a_tls_client_without_a_certificate_is_refused(cluster: Cluster, service: str) -> None:
    code, _ = _check(
        cluster.address(service), TLSConfig(enabled=True, ca_file=str(cluster.ca.cert))
    )
    assert code is grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("service", SERVICES)
def test_a_client_certificate_signed_by_another_ca_is_refused(
    cluster: Cluster, service: str
) -> None:
    impostor = cluster.rogue.issue(f"impostor-{service}")
    tls = TLSConfig(
        enabled=True,
        ca_file=str(cluster.ca.cert),
        cert_file=str(impostor.cert),
        key_file=str(impostor.key),
    )
    code, _ = _check(cluster.address(service), tls)
    assert code is grpc.StatusCode.UNAVAILABLE


def test_a_client_that_does_not_trust_the_jobs_ca_refuses_the_server(cluster: Cluster) -> None:
    tls = cluster.client_tls.model_copy(update={"ca_file": str(cluster.rogue.cert)})
    code, details = _check(cluster.address("buffer"), tls)
    assert code is grpc.StatusCode.UNAVAILABLE
    assert "CERTIFICATE_VERIFY_FAILED" in details


def test_kuberl_health_takes_its_tls_settings_from_the_environment(cluster: Cluster) -> None:
    tls = cluster.client_tls
    env = {
        **os.environ,
        "KUBERL_TLS__ENABLED": "true",
        "KUBERL_TLS__CA_FILE": str(tls.ca_file),
        "KUBERL_TLS__CERT_FILE": str(tls.cert_file),
        "KUBERL_TLS__KEY_FILE": str(tls.key_file),
    }
    args = [sys.executable, "-m", "kuberl.cli", "health", "--timeout", "10"]
    addresses = [cluster.address(s) for s in SERVICES]
    with_tls = subprocess.run([*args, *addresses], env=env, capture_output=True, text=True)
    plain = {k: v for k, v in env.items() if not k.startswith("KUBERL_TLS__")}
    without = subprocess.run(
        [*args, "--timeout", "1", addresses[0]], env=plain, capture_output=True, text=True
    )
    assert (with_tls.returncode, with_tls.stdout.count(" SERVING")) == (0, len(SERVICES))
    assert (without.returncode, without.stdout.split()[-1]) == (1, "UNAVAILABLE")


# ---------------------------------------------------------------- server-only TLS, rotation


def _install(pair_cert: Path, pair_key: Path, cert: Path, key: Path) -> None:
    """Replace cert/key the way a Secret volume update does: new files renamed into place."""
    for src, dst in ((pair_key, key), (pair_cert, cert)):
        tmp = dst.with_suffix(".new")
        tmp.write_bytes(src.read_bytes())
        os.replace(tmp, dst)


def _served_certificate(port: int, ca: Path) -> str:
    """The common name in the certificate a fresh TLS connection is served."""
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    (name,) = x509.load_der_x509_certificate(der).subject.get_attributes_for_oid(
        x509.oid.NameOID.COMMON_NAME
    )
    return str(name.value)


@pytest.fixture(scope="module")
def server_tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServiceProcess, Path]]:
    tmp = tmp_path_factory.mktemp("server-tls")
    ca = authority(tmp / "pki")
    first = ca.issue("weight-sync-1")
    cert, key = tmp / "tls.crt", tmp / "tls.key"
    _install(first.cert, first.key, cert, key)
    job = {
        "tls": {
            "enabled": True,
            "ca_file": str(ca.cert),
            "cert_file": str(cert),
            "key_file": str(key),
        },
        "weight_sync": {
            "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
            "snapshot_dir": str(tmp / "snapshots"),
            "shm_dir": str(tmp / "shm"),
        },
    }
    (tmp / "job.yaml").write_text(yaml.safe_dump(job))
    with ServiceProcess.kuberl("weight_sync", tmp / "job.yaml", tmp).wait_listening(60) as proc:
        ca.issue("weight-sync-2")  # the rotation's next certificate, in tmp/pki
        yield proc, tmp


def test_with_server_only_tls_a_client_needs_no_certificate_but_must_use_tls(
    server_tls: tuple[ServiceProcess, Path],
) -> None:
    proc, tmp = server_tls
    ca = str(tmp / "pki" / "ca.pem")
    deadline = time.monotonic() + 60
    while _check(proc.address, TLSConfig(enabled=True, ca_file=ca))[0] is not grpc.StatusCode.OK:
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.1)
    assert _check(proc.address, TLSConfig())[0] is grpc.StatusCode.UNAVAILABLE


def test_a_rotated_certificate_is_served_to_new_connections_without_a_restart(
    server_tls: tuple[ServiceProcess, Path],
) -> None:
    proc, tmp = server_tls
    ca = tmp / "pki" / "ca.pem"
    before = _served_certificate(proc.port, ca)
    _install(tmp / "pki" / "ca-weight-sync-2.pem", tmp / "pki" / "ca-weight-sync-2.key",
             tmp / "tls.crt", tmp / "tls.key")  # fmt: skip
    after = _served_certificate(proc.port, ca)
    still = _check(proc.address, TLSConfig(enabled=True, ca_file=str(ca)))[0]
    assert (before, after, still, proc.proc.poll()) == (
        "weight-sync-1",
        "weight-sync-2",
        grpc.StatusCode.OK,
        None,
    )
