"""What a service process imports before it serves: the services that never touch a tensor
(buffer, reward and its worker, weight-sync, the local supervisor) start without torch and
transformers, whose import costs each process a CPU second or more (vs_trl's CPU accounting)."""

from __future__ import annotations

import json
import subprocess
import sys

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
