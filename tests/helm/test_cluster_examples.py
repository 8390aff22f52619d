"""The two cluster values files of docs/kubernetes.md ("From an empty GPU cluster to a running
job"), installed over examples/gsm8k-qwen.yaml as the page says: value sets `one-node-example` and
`two-trainer-nodes-example` in chart.py, so every generic test (helm lint --strict,
kubernetes-validate --strict, the services' own job loader, security, disk requests) covers them.
Here: that each asks for the GPUs its header promises."""

from __future__ import annotations

from typing import Any

from tests.helm.chart import CHART, pod_spec, render, workloads
from tests.support import REPO


def _gpus(value_set: str) -> dict[str, int]:
    """GPUs requested per component, all replicas counted."""
    found: dict[str, int] = {}
    for doc in workloads(render(value_set)):
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        component = doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        per_pod = sum(
            int(c["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
            for c in pod_spec(doc)["containers"]
        )
        found[component] = found.get(component, 0) + per_pod * int(doc["spec"]["replicas"])
    return {c: n for c, n in found.items() if n}


def _claims(value_set: str) -> dict[str, Any]:
    return {
        d["metadata"]["name"]: d["spec"]["accessModes"]
        for d in render(value_set).all("PersistentVolumeClaim")
    }


def test_one_node_uses_exactly_its_eight_gpus() -> None:
    assert _gpus("one-node-example") == {"trainer": 4, "rollout": 3, "weight-sync": 1}


def test_two_trainer_nodes_and_eight_rollout_pods_take_25_gpus_on_shared_claims() -> None:
    rendered = render("two-trainer-nodes-example")
    assert _gpus("two-trainer-nodes-example") == {"trainer": 16, "rollout": 8, "weight-sync": 1}
    assert _claims("two-trainer-nodes-example") == {
        "rl-kuberl-checkpoints-rwx-nfs": ["ReadWriteMany"]
    }
    assert [d["metadata"]["name"] for d in rendered.all("PriorityClass")] == ["rl-kuberl-trainer"]


def test_the_docs_install_both_files() -> None:
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    files = sorted(p.name for p in (CHART / "examples").glob("values-*.yaml"))
    assert files == ["values-one-node.yaml", "values-two-trainer-nodes.yaml"]
    assert all(f"helm/kuberl/examples/{name}" in docs for name in files)
