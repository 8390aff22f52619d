"""Scheduling on a shared GPU cluster: runtime class, priority, affinity and topology spread per
component, ephemeral-storage for the pods' emptyDirs (disk pressure evicts pods above their
requests first), and disruption budgets for the trainer and Redis."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helm.chart import VALUE_SETS, pod_spec, render, workloads

_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def _bytes(quantity: str | int) -> int:
    text = str(quantity)
    for unit, factor in _UNITS.items():
        if text.endswith(unit):
            return int(text.removesuffix(unit)) * factor
    return int(text)


def _component(doc: dict[str, Any]) -> str:
    return str(doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"])


def _pods(value_set: str, **overrides: Any) -> dict[str, dict[str, Any]]:
    """Pod specs by component (the trainer's rank-0 StatefulSet for the trainer)."""
    docs = workloads(render(value_set, **overrides))
    return {
        _component(d): pod_spec(d)
        for d in docs
        if d["kind"] != "Pod" and not d["metadata"]["name"].endswith("-worker")
    }


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_gpu_pods_run_with_the_runtime_class_each_component_names() -> None:
    gpu = {"runtimeClassName": "nvidia"}
    pods = _pods("defaults", rollout=gpu, trainer=gpu)
    classes = {name: spec.get("runtimeClassName") for name, spec in pods.items()}
    # weight-sync relays over NCCL from a GPU here, so it takes rollout's runtime class.
    assert classes == {
        "buffer": None,
        "reward": None,
        "redis": None,
        "weight-sync": "nvidia",
        "rollout": "nvidia",
        "trainer": "nvidia",
    }


def _trainer_gpus(**trainer: Any) -> Any:
    spec = _pods("defaults", trainer=trainer)["trainer"]
    return spec["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")


def test_trainer_pods_request_gpus_per_node_by_default() -> None:
    assert _trainer_gpus(gpusPerNode=4) == 4


def test_a_cpu_trainer_requests_no_gpu_so_a_cpu_cluster_can_schedule_it() -> None:
    assert _trainer_gpus(gpu=False) is None


def test_no_runtime_class_is_set_by_default() -> None:
    assert {s.get("runtimeClassName") for s in _pods("defaults").values()} == {None}


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_each_pod_requests_the_disk_its_emptydirs_may_fill(value_set: str) -> None:
    short = {}
    for doc in workloads(render(value_set)):
        spec = pod_spec(doc)
        disk = sum(
            _bytes(v["emptyDir"].get("sizeLimit", 0))
            for v in spec.get("volumes", [])
            if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"
        )
        requested = limited = 0
        for c in spec["containers"]:
            requested += _bytes(c["resources"].get("requests", {}).get("ephemeral-storage", 0))
            limited += _bytes(c["resources"].get("limits", {}).get("ephemeral-storage", 0))
        if doc["kind"] != "Pod" and not disk < requested == limited:
            short[doc["metadata"]["name"]] = (disk, requested, limited)
    assert short == {}


def test_a_rollout_pod_asks_for_its_125gi_of_scratch_plus_logs() -> None:
    sglang = next(c for c in _pods("defaults")["rollout"]["containers"] if c["name"] == "sglang")
    # tmp 1Gi + work 10Gi + compile caches 50Gi + weight snapshots 64Gi, and 1Gi of logs.
    assert sglang["resources"]["requests"]["ephemeral-storage"] == "126Gi"


def test_an_ephemeral_storage_the_user_sets_is_kept() -> None:
    resources = {"requests": {"ephemeral-storage": "300Gi"}, "limits": {"memory": "8Gi"}}
    trainer = _pods("defaults", trainer={"resources": resources})["trainer"]["containers"][0]
    assert (
        trainer["resources"]["requests"]["ephemeral-storage"],
        trainer["resources"]["limits"]["ephemeral-storage"],
    ) == ("300Gi", "62Gi")


def test_a_trainer_priority_class_made_by_the_chart_outranks_every_other_pod() -> None:
    rendered = render("defaults", trainer={"priorityClass": {"create": True}})
    (created,) = rendered.all("PriorityClass")
    pods = _pods("defaults", trainer={"priorityClass": {"create": True}})
    classes = {name: spec.get("priorityClassName") for name, spec in pods.items()}
    assert (created["metadata"]["name"], created["value"]) == ("rl-kuberl-trainer", 1000000)
    assert classes == {
        "buffer": None,
        "reward": None,
        "redis": None,
        "weight-sync": None,
        "rollout": None,
        "trainer": "rl-kuberl-trainer",
    }


def test_a_components_priority_class_wins_over_the_global_one() -> None:
    pods = _pods("defaults", priorityClassName="batch", rollout={"priorityClassName": "spot"})
    classes = {name: spec.get("priorityClassName") for name, spec in pods.items()}
    assert (classes["rollout"], classes["buffer"], classes["trainer"]) == ("spot", "batch", "batch")
    assert "PriorityClass" not in {d["kind"] for d in render("defaults").docs}


def test_rollout_pods_avoid_trainer_nodes_and_pack_with_each_other() -> None:
    rendered = render("multi-node-trainer")
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in workloads(rendered)
        if d["kind"] != "Pod"
    }
    affinity = pod_spec(rendered.get("Deployment", "rollout"))["affinity"]
    (avoid,) = affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    (pack,) = affinity["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    avoided = {
        n
        for n, labels in pods.items()
        if _matches(avoid["podAffinityTerm"]["labelSelector"], labels)
    }
    packed = {
        n
        for n, labels in pods.items()
        if _matches(pack["podAffinityTerm"]["labelSelector"], labels)
    }
    assert (avoided, packed) == (
        {"rl-kuberl-trainer", "rl-kuberl-trainer-worker"},
        {"rl-kuberl-rollout"},
    )
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in str(affinity)


def test_topology_spread_constraints_are_rendered_per_component() -> None:
    spread = [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "reward"}},
        }
    ]
    pods = _pods("defaults", reward={"topologySpreadConstraints": spread})
    assert {n for n, s in pods.items() if s.get("topologySpreadConstraints")} == {"reward"}
    assert pods["reward"]["topologySpreadConstraints"] == spread


def test_the_trainer_and_redis_have_disruption_budgets_that_hold_off_drains() -> None:
    rendered = render("multi-node-trainer")
    trainer_pods = [
        d["spec"]["template"]["metadata"]["labels"]
        for d in rendered.all("StatefulSet")
        if _component(d) == "trainer"
    ]
    trainer, redis = (
        rendered.get("PodDisruptionBudget", "trainer"),
        rendered.get("PodDisruptionBudget", "redis"),
    )
    assert (trainer["spec"]["maxUnavailable"], redis["spec"]["maxUnavailable"]) == (0, 0)
    assert len(trainer_pods) == 2
    assert all(_matches(trainer["spec"]["selector"], labels) for labels in trainer_pods)


def test_a_trainer_class_named_in_values_wins_over_the_one_the_chart_makes() -> None:
    trainer = {"priorityClassName": "gpu-training", "priorityClass": {"create": True}}
    assert _pods("defaults", trainer=trainer)["trainer"]["priorityClassName"] == "gpu-training"
