"""examples/gsm8k-qwen.yaml and examples/gsm8k-tools.yaml installed as their headers and
docs/kubernetes.md say: the job file as the chart's `job` value beside a cluster's values (value
sets `gsm8k-qwen-example` and `gsm8k-tools-example` in chart.py, whose every manifest
tests/helm/test_manifests.py validates strictly).

The chart must hand the services the example's training as written and change only the wiring a
cluster needs, and the workloads must be the ones the example was written for.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kuberl.common.config import parse_job_config
from tests.helm.chart import pod_spec, render
from tests.support import REPO

EXAMPLE = REPO / "examples" / "gsm8k-qwen.yaml"
# What the chart sets for every install (helm/kuberl/templates/_helpers.tpl): service addresses,
# its Redis, folders on the pods' volumes, and the per-version bound that keeps weight-sync's
# volume within its size limit.
WIRING = {
    "endpoints",
    "redis.url",
    "rollout.peer_port",
    "rollout.engine.snapshot_dir",
    "trainer.checkpoint_dir",
    "weight_sync.snapshot_dir",
    "weight_sync.shm_dir",
    "weight_sync.max_version_bytes",
}


def _leaves(value: Any, path: str = "") -> dict[str, Any]:
    if not isinstance(value, dict):
        return {path: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(_leaves(item, f"{path}.{key}" if path else key))
    return out


def _resolved(doc: dict[str, Any], source: str) -> dict[str, Any]:
    return _leaves(parse_job_config(doc, env={}, source=source).model_dump(mode="json"))


@pytest.mark.parametrize("name", ["gsm8k-qwen", "gsm8k-tools"])
def test_the_chart_changes_only_the_wiring_of_the_gsm8k_examples(name: str) -> None:
    path = REPO / "examples" / f"{name}.yaml"
    rendered = render(f"{name}-example").get("ConfigMap", "job")["data"]["job.yaml"]
    example = _resolved(yaml.safe_load(path.read_text()), str(path))
    served = _resolved(yaml.safe_load(rendered), "job ConfigMap")
    changed = {
        "endpoints" if path.startswith("endpoints.") else path
        for path in example.keys() | served.keys()
        if example.get(path) != served.get(path)
    }
    assert changed == WIRING


def test_the_gsm8k_example_runs_sglang_replicas_and_a_four_gpu_zero_trainer() -> None:
    rendered = render("gsm8k-qwen-example")
    rollout = rendered.get("Deployment", "rollout")
    sglang = next(c for c in pod_spec(rollout)["containers"] if c["name"] == "sglang")
    trainer = pod_spec(rendered.get("StatefulSet", "trainer"))["containers"][0]
    assert (
        rollout["spec"]["replicas"],
        sglang["args"][sglang["args"].index("--model-path") + 1],
        trainer["command"],
        "--nproc-per-node=4" in trainer["args"],
        trainer["resources"]["limits"]["nvidia.com/gpu"],
    ) == (2, yaml.safe_load(EXAMPLE.read_text())["model"]["path"], ["torchrun"], True, 4)
