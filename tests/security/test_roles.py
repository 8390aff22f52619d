"""Per-RPC roles (kuberl.common.roles): one decision, from certificates or from a run's tokens.

A real buffer and weight-sync (`kuberl serve`, real Redis) check roles with each source of
identity in turn. Under mutual TLS with `tls.roles`, each serves its own certificate naming it
(URI SAN `spiffe://kuberl/<job>/<component>`) and callers carry certificates from the same CA;
in local mode's way, each is started with the run's identity file (`issue_tokens`) and callers
present tokens. The callers: the job's trainer, the job's rollout, another job's trainer, and
one without a kuberl identity. Each restricted method answers only its roles; every other caller
gets PERMISSION_DENIED, counted by method and role; reads stay open to every caller.
"""

from __future__ import annotations

import re
import secrets
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.api.buffer.v1 import buffer_pb2_grpc
from kuberl.api.weight_sync.v1 import weight_sync_pb2 as wpb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc
from kuberl.common.channels import health_status, sync_channel
from kuberl.common.config import ConfigError, TLSConfig
from kuberl.common.redis_server import EmbeddedRedis
from kuberl.common.roles import (
    IDENTITIES_ENV,
    Certificates,
    Tokens,
    identity_source,
    issue_tokens,
)
from tests.integration.buffer_support import write_job
from tests.security.certs import Pair, authority
from tests.support import ServiceProcess

C = grpc.StatusCode
JOB = f"roles{uuid.uuid4().hex[:6]}"


def _identity(component: str, job: str = JOB) -> tuple[str, ...]:
    return (f"spiffe://kuberl/{job}/{component}",)


@dataclass
class Roles:
    procs: dict[str, ServiceProcess]
    #: caller -> what its channel needs: a TLS config (certificates) or a token ('' for none)
    callers: dict[str, TLSConfig | str]

    def channel(self, service: str, caller: str) -> grpc.Channel:
        who = self.callers[caller]
        address = self.procs[service].address
        if isinstance(who, TLSConfig):
            return sync_channel(address, tls=who, token="")
        return sync_channel(address, tls=TLSConfig(), token=who)

    def code(self, service: str, caller: str, method: str, request: object) -> C:
        with self.channel(service, caller) as channel:
            stub = {
                "buffer": buffer_pb2_grpc.BufferServiceStub,
                "weight_sync": weight_sync_pb2_grpc.WeightSyncServiceStub,
            }[service](channel)
            try:
                getattr(stub, method)(request, timeout=20)
            except grpc.RpcError as exc:
                return exc.code()
        return C.OK

    def denied(self, service: str) -> dict[tuple[str, str], float]:
        url = f"http://127.0.0.1:{self.procs[service].metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        metric = f"kuberl_{service}_permission_denied_total"
        return {
            (m, r): float(v)
            for m, r, v in re.findall(metric + r'\{method="(\w+)",role="(\w+)"\} (\S+)', text)
        }


def _service_job(tmp: Path, redis_url: str, service: str, tls: dict[str, Any]) -> Path:
    doc = yaml.safe_load(write_job(tmp, redis_url, job=JOB, prompts=4).read_text())
    doc["tls"] = tls
    doc["weight_sync"] = {
        "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
        "snapshot_dir": str(tmp / "snapshots"),
        "shm_dir": str(tmp / "shm"),
    }
    path = tmp / f"{service}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _by_certificates(tmp: Path, redis_url: str) -> Roles:
    ca = authority(tmp / "pki", "ca")

    def tls(pair: Pair) -> TLSConfig:
        return TLSConfig(
            enabled=True, ca_file=str(ca.cert), cert_file=str(pair.cert), key_file=str(pair.key)
        )

    callers: dict[str, TLSConfig | str] = {
        "trainer": tls(ca.issue("trainer", uris=_identity("trainer"))),
        "rollout": tls(ca.issue("rollout", uris=_identity("rollout/r0"))),  # replica r0
        "other-job-trainer": tls(ca.issue("other", uris=_identity("trainer", "another-job"))),
        "no-identity": tls(ca.issue("plain")),
    }
    procs = {}
    for service in ("buffer", "weight_sync"):
        own = ca.issue(service, uris=_identity(service))
        settings = {
            "enabled": True,
            "ca_file": str(ca.cert),
            "cert_file": str(own.cert),
            "key_file": str(own.key),
            "require_client_cert": True,
            "roles": True,
        }
        procs[service] = ServiceProcess.kuberl(
            service, _service_job(tmp, redis_url, service, settings), tmp
        )
    return Roles(procs, callers)


def _by_tokens(tmp: Path, redis_url: str) -> Roles:
    """As `kuberl run` starts them: each process's identity is its token for the run."""
    names = {"trainer": "trainer", "rollout": "rollout/r0", "buffer": "buffer"}
    tokens = issue_tokens(tmp / "roles", JOB, {**names, "weight_sync": "weight_sync"})
    other = issue_tokens(tmp / "other-roles", "another-job", {"trainer": "trainer"})
    callers: dict[str, TLSConfig | str] = {
        "trainer": tokens["trainer"],
        "rollout": tokens["rollout"],
        "other-job-trainer": other["trainer"],
        "no-identity": "",
        "forged-token": secrets.token_urlsafe(32),
    }
    env = {IDENTITIES_ENV: str(tmp / "roles" / "identities.json")}
    procs = {
        service: ServiceProcess.kuberl(
            service, _service_job(tmp, redis_url, service, {}), tmp, env=env
        )
        for service in ("buffer", "weight_sync")
    }
    return Roles(procs, callers)


@pytest.fixture(scope="module", params=["certificates", "tokens"])
def roles(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Roles]:
    tmp = tmp_path_factory.mktemp("roles")
    with EmbeddedRedis(tmp / "redis", die_with_parent=True) as redis:
        start = _by_certificates if request.param == "certificates" else _by_tokens
        found = start(tmp, redis.url)
        try:
            for service, proc in found.procs.items():
                proc.wait_listening(120)
                with found.channel(service, "trainer") as channel:
                    wait_until_serving(channel)
            yield found
        finally:
            for proc in found.procs.values():
                proc.stop()


def wait_until_serving(channel: grpc.Channel, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while health_status(channel) != "SERVING":
        assert time.monotonic() < deadline, "the service did not report SERVING"
        time.sleep(0.1)


LEASE = bpb.LeasePromptsRequest(max_prompts=1, consumer="r0")
GET = bpb.GetBatchRequest(num_groups=1, consumer="trainer")
PUBLISH = wpb.PublishRequest(version=10**6, transports=[wpb.TRANSPORT_SNAPSHOT])


@pytest.mark.parametrize(
    ("service", "method", "request_", "allowed"),
    [
        ("buffer", "GetBatch", GET, "trainer"),
        ("buffer", "LeasePrompts", LEASE, "rollout"),
        ("buffer", "SetPolicyVersion", bpb.SetPolicyVersionRequest(version=1), "trainer"),
        ("weight_sync", "Publish", PUBLISH, "trainer"),
    ],
    ids=["buffer.GetBatch", "buffer.LeasePrompts", "buffer.SetPolicyVersion", "ws.Publish"],
)
def test_only_the_methods_roles_may_call_it(
    roles: Roles, service: str, method: str, request_: object, allowed: str
) -> None:
    codes = {caller: roles.code(service, caller, method, request_) for caller in roles.callers}
    assert codes == {
        caller: C.OK if caller == allowed else C.PERMISSION_DENIED for caller in roles.callers
    }


def test_reads_stay_open_to_every_caller_the_ca_admitted(roles: Roles) -> None:
    codes = {
        caller: roles.code("buffer", caller, "GetStats", bpb.GetStatsRequest())
        for caller in roles.callers
    }
    assert set(codes.values()) == {C.OK}


def test_every_refusal_is_counted_by_method_and_role(roles: Roles) -> None:
    before = roles.denied("buffer").get(("Ack", "rollout"), 0.0)
    code = roles.code("buffer", "rollout", "Ack", bpb.AckRequest(batch_id="train-x"))
    assert (code, roles.denied("buffer").get(("Ack", "rollout"), 0.0) - before) == (
        C.PERMISSION_DENIED,
        1.0,
    )


def test_an_engine_registers_and_beats_only_under_its_own_identity(roles: Roles) -> None:
    def register(engine_id: str) -> wpb.RegisterEngineRequest:
        info = wpb.EngineInfo(engine_id=engine_id, transports=[wpb.TRANSPORT_SNAPSHOT])
        return wpb.RegisterEngineRequest(engine=info)

    codes = (
        roles.code("weight_sync", "rollout", "RegisterEngine", register("r0")),
        roles.code("weight_sync", "rollout", "RegisterEngine", register("r1")),
        roles.code("weight_sync", "rollout", "Heartbeat", wpb.HeartbeatRequest(engine_id="r1")),
    )
    assert codes == (C.OK, C.PERMISSION_DENIED, C.PERMISSION_DENIED)


def test_roles_need_mutual_tls(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="require_client_cert"):
        TLSConfig(enabled=True, cert_file="c", key_file="k", roles=True)


def test_certificates_are_the_identity_under_tls_roles_whatever_the_environment(
    tmp_path: Path,
) -> None:
    issue_tokens(tmp_path, JOB, {"trainer": "trainer"})
    env = {IDENTITIES_ENV: str(tmp_path / "identities.json")}
    mtls = TLSConfig(
        enabled=True, ca_file="ca", cert_file="c", key_file="k", require_client_cert=True
    )
    sources = (
        identity_source(mtls.model_copy(update={"roles": True}), env),
        identity_source(TLSConfig(), env),
        identity_source(TLSConfig(), {}),
    )
    assert [type(s) for s in sources] == [Certificates, Tokens, type(None)]


def test_a_runs_tokens_are_readable_by_their_owner_only_and_its_identity_file_holds_none(
    tmp_path: Path,
) -> None:
    tokens = issue_tokens(tmp_path / "roles", JOB, {"trainer": "trainer", "r0": "rollout/r0"})
    modes = {
        p.name: p.stat().st_mode & 0o777
        for p in [tmp_path / "roles", *(tmp_path / "roles").iterdir()]
    }
    text = (tmp_path / "roles" / "identities.json").read_text()
    assert (modes, any(t in text for t in tokens.values())) == (
        {"roles": 0o700, "trainer.token": 0o600, "r0.token": 0o600, "identities.json": 0o600},
        False,
    )


def test_a_service_started_without_an_identity_file_checks_no_roles(tmp_path: Path) -> None:
    """Services started by hand (tests, benchmarks) keep plaintext's open behaviour."""
    with EmbeddedRedis(tmp_path / "redis", die_with_parent=True) as redis:
        job = _service_job(tmp_path, redis.url, "buffer", {})
        with ServiceProcess.kuberl("buffer", job, tmp_path) as buffer:
            buffer.wait_serving(120)
            with sync_channel(buffer.address, tls=TLSConfig(), token="") as channel:
                stub = buffer_pb2_grpc.BufferServiceStub(channel)
                answer = stub.SetPolicyVersion(bpb.SetPolicyVersionRequest(version=0), timeout=20)
    assert answer is not None


def test_an_unreadable_identity_file_stops_the_service_naming_the_variable(
    tmp_path: Path,
) -> None:
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match=IDENTITIES_ENV):
        identity_source(TLSConfig(), {IDENTITIES_ENV: str(tmp_path / "bad.json")})
