"""Per-RPC roles under mutual TLS (`tls.roles`, kuberl.common.roles), with real certificates.

A real buffer and weight-sync (`kuberl serve`, real Redis) serve mutual TLS with roles on, each
with its own certificate naming it (URI SAN `spiffe://kuberl/<job>/<component>`). Callers carry
certificates from the same CA: the job's trainer, the job's rollout, another job's trainer, and a
certificate without a kuberl identity. Each restricted method answers only its roles; every
other caller gets PERMISSION_DENIED, counted by method and role; reads stay open to every caller
the CA admitted.
"""

from __future__ import annotations

import re
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.api.buffer.v1 import buffer_pb2_grpc
from kuberl.api.weight_sync.v1 import weight_sync_pb2 as wpb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc
from kuberl.common.channels import sync_channel, wait_serving
from kuberl.common.config import TLSConfig
from kuberl.common.redis_server import EmbeddedRedis
from tests.integration.buffer_support import write_job
from tests.security.certs import Authority, Pair, authority
from tests.support import ServiceProcess

C = grpc.StatusCode
JOB = f"roles{uuid.uuid4().hex[:6]}"


def _identity(component: str, job: str = JOB) -> tuple[str, ...]:
    return (f"spiffe://kuberl/{job}/{component}",)


@dataclass
class Roles:
    ca: Authority
    callers: dict[str, Pair]
    procs: dict[str, ServiceProcess]

    def tls(self, caller: str) -> TLSConfig:
        pair = self.callers[caller]
        return TLSConfig(
            enabled=True,
            ca_file=str(self.ca.cert),
            cert_file=str(pair.cert),
            key_file=str(pair.key),
        )

    def code(self, service: str, caller: str, method: str, request: object) -> C:
        with sync_channel(self.procs[service].address, tls=self.tls(caller)) as channel:
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


@pytest.fixture(scope="module")
def roles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Roles]:
    tmp = tmp_path_factory.mktemp("roles")
    ca = authority(tmp / "pki", "ca")
    callers = {
        "trainer": ca.issue("trainer", uris=_identity("trainer")),
        "rollout": ca.issue("rollout", uris=_identity("rollout/r0")),  # replica r0
        "other-job-trainer": ca.issue("other", uris=_identity("trainer", "another-job")),
        "no-identity": ca.issue("plain"),
    }
    procs: dict[str, ServiceProcess] = {}
    with EmbeddedRedis(tmp / "redis", die_with_parent=True) as redis:
        try:
            for service in ("buffer", "weight_sync"):
                own = ca.issue(service, uris=_identity(service))
                doc = yaml.safe_load(write_job(tmp, redis.url, job=JOB, prompts=4).read_text())
                doc["tls"] = {
                    "enabled": True,
                    "ca_file": str(ca.cert),
                    "cert_file": str(own.cert),
                    "key_file": str(own.key),
                    "require_client_cert": True,
                    "roles": True,
                }
                doc["weight_sync"] = {
                    "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
                    "snapshot_dir": str(tmp / "snapshots"),
                    "shm_dir": str(tmp / "shm"),
                }
                path = tmp / f"{service}.yaml"
                path.write_text(yaml.safe_dump(doc))
                procs[service] = ServiceProcess.kuberl(service, path, tmp)
            found = Roles(ca, callers, procs)
            for proc in procs.values():
                proc.wait_listening(120)
                wait_serving(proc.address, 120, tls=found.tls("trainer"))
            yield found
        finally:
            for proc in procs.values():
                proc.stop()


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
