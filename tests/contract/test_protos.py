"""The gRPC contracts: every service has its versioned proto, it compiles, and the committed
generated Python is exactly what the pinned grpcio-tools produces."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from tests.support import REPO

SERVICES = {
    "buffer": "BufferService",
    "reward": "RewardService",
    "rollout": "RolloutService",
    "trainer": "TrainerService",
    "weight_sync": "WeightSyncService",
}


def _generator():
    spec = importlib.util.spec_from_file_location("protogen", REPO / "protos" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_each_service_has_a_versioned_proto_package(service: str) -> None:
    text = (REPO / "protos" / "kuberl" / service / "v1" / f"{service}.proto").read_text()
    assert re.search(rf"^package kuberl\.{service}\.v1;$", text, re.MULTILINE)


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_each_service_compiles_and_defines_its_grpc_service(service: str) -> None:
    pb2 = importlib.import_module(f"kuberl.api.{service}.v1.{service}_pb2")
    importlib.import_module(f"kuberl.api.{service}.v1.{service}_pb2_grpc")
    assert pb2.DESCRIPTOR.services_by_name[SERVICES[service]].full_name == (
        f"kuberl.{service}.v1.{SERVICES[service]}"
    )


def test_regenerating_the_protos_changes_no_committed_file(tmp_path: Path) -> None:
    written = _generator().generate(tmp_path)
    differing = [
        str(f.relative_to(tmp_path))
        for f in written
        if f.read_bytes() != (REPO / "protos" / f.relative_to(tmp_path)).read_bytes()
    ]
    assert written and differing == [], "run `make protos` and commit the result"


def test_no_committed_generated_file_is_orphaned(tmp_path: Path) -> None:
    written = {f.relative_to(tmp_path) for f in _generator().generate(tmp_path)}
    committed = {p.relative_to(REPO / "protos") for p in (REPO / "protos").rglob("*_pb2*.py*")}
    assert committed == written
