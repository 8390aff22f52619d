"""What a service process imports before it serves: the services that never touch a tensor
(buffer, reward and its worker, weight-sync, the local supervisor) start without torch and
transformers, whose import costs each process a CPU second or more (vs_trl's CPU accounting)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

HEAVY = ("torch", "transformers", "deepspeed")
PROBE = (
    "import importlib, json, sys; importlib.import_module(sys.argv[1]); "
    f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))"
)


def heavy_imports(module: str) -> list[str]:
    """The heavy packages a fresh interpreter holds after importing `module`."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, module],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "module",
    [
        "kuberl.buffer.server",
        "kuberl.reward.server",
        "kuberl.reward.worker",
        "kuberl.weight_sync.server",
        "kuberl.local.supervisor",
    ],
)
def test_a_service_without_tensors_starts_without_torch(module: str) -> None:
    assert heavy_imports(module) == []


def test_the_weights_package_imports_torch_only_for_what_needs_it() -> None:
    assert heavy_imports("kuberl.common.weights.chunks") == []
    assert heavy_imports("kuberl.common.weights.engine") == ["torch"]


def test_the_weights_package_still_exports_its_api_by_name() -> None:
    import kuberl.common.weights as weights
    from kuberl.common.weights.engine import EngineClient

    assert weights.EngineClient is EngineClient
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        weights.Nothing  # noqa: B018


def test_weight_sync_imports_torch_at_start_when_it_offers_a_broadcast(tmp_path: Path) -> None:
    probe = (
        "import asyncio, sys\n"
        "from kuberl.common.config import parse_job_config\n"
        "from kuberl.weight_sync.server import create_service\n"
        "doc = {'job': {'name': 'probe'}, 'model': {'path': sys.argv[1]},\n"
        "       'weight_sync': {'transports': sys.argv[2].split(','),\n"
        "                       'snapshot_dir': sys.argv[1]}}\n"
        "service = create_service(parse_job_config(doc, env={}, source='probe'))\n"
        "async def main():\n"
        "    await service.start()\n"
        "    await service.stop()\n"
        "asyncio.run(main())\n"
        "print('torch' in sys.modules)\n"
    )

    def torch_after_start(transports: str) -> bool:
        out = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path), transports],
            cwd=REPO, capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        return out.stdout.strip().splitlines()[-1] == "True"

    assert (torch_after_start("shm,snapshot"), torch_after_start("gloo,snapshot")) == (False, True)
