"""Upgrade paths: each renders the chart before and after a change of values and checks, with
tests/helm/upgrade.py, what Kubernetes would refuse (immutable fields: the upgrade fails
half-applied) and which workloads it would restart."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.chart import CHART, FULLNAME, NAMESPACE, RELEASE, render, render_values
from tests.helm.upgrade import refused_changes, restarted

helm = pytest.importorskip("helm_python", reason="helm-python-sdk not installed")

RWX = {"accessModes": ["ReadWriteMany"], "storageClass": "nfs"}
KUBERL_WORKLOADS = {
    f"Deployment/{FULLNAME}-{c}" for c in ("buffer", "reward", "weight-sync", "rollout")
} | {f"StatefulSet/{FULLNAME}-trainer"}

# Upgrades a user makes, none of which may change a field Kubernetes refuses to change.
UPGRADES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "one trainer node to two": ({}, {"trainer": {"nodes": 2, "checkpoints": RWX}}),
    "two trainer nodes to four": (
        {"trainer": {"nodes": 2, "checkpoints": RWX}},
        {"trainer": {"nodes": 4, "checkpoints": RWX}},
    ),
    "checkpoint storage class": ({}, {"trainer": {"checkpoints": {"storageClass": "fast"}}}),
    "larger checkpoint claim": ({}, {"trainer": {"checkpoints": {"size": "400Gi"}}}),
    "a new job": ({}, {"job": {"rollout": {"group_size": 16}}}),
    "a new image tag": ({}, {"images": {"rollout": {"tag": "0.2.0"}}}),
    "more rollout replicas": ({}, {"rollout": {"replicas": 6}}),
    "autoscaling on": ({}, {"rollout": {"autoscaling": {"enabled": True}}}),
    "sglang over two GPUs": ({}, {"rollout": {"sglang": {"tpSize": 2}}}),
    "redis maxmemory": ({}, {"redis": {"maxmemory": "3gb"}}),
    "monitoring on": ({}, {"metrics": {"podMonitor": {"enabled": True}}}),
    "mutual TLS on": ({}, {"tls": {"enabled": True, "secretName": "grpc-tls"}}),
    "trainer priority class": ({}, {"trainer": {"priorityClass": {"create": True}}}),
}


def _upgrade(before: dict[str, Any], after: dict[str, Any]):
    return render("defaults", **before), render("defaults", **after)


@pytest.mark.parametrize("name", sorted(UPGRADES))
def test_an_upgrade_changes_no_field_kubernetes_refuses_to_change(name: str) -> None:
    before, after = _upgrade(*UPGRADES[name])
    assert [str(r) for r in refused_changes(before, after)] == []


def test_more_trainer_nodes_get_a_new_shared_claim_and_keep_the_old_one() -> None:
    before, after = _upgrade(*UPGRADES["one trainer node to two"])
    claims = [
        {d["metadata"]["name"] for d in r.all("PersistentVolumeClaim")} for r in (before, after)
    ]
    kept = before.get("PersistentVolumeClaim", "checkpoints")["metadata"]["annotations"]
    assert claims == [{f"{FULLNAME}-checkpoints"}, {f"{FULLNAME}-checkpoints-rwx-nfs"}]
    assert kept["helm.sh/resource-policy"] == "keep"


def test_more_nodes_on_a_single_node_claim_fail_naming_the_new_claim() -> None:
    with pytest.raises(helm.HelmRenderError) as err:
        render_values({"trainer": {"nodes": 2, "checkpoints": {"storageClass": "nfs"}}})
    message = str(err.value)
    assert f"claim {FULLNAME}-checkpoints-nfs is [ReadWriteOnce]" in message
    assert f"creates a new claim, {FULLNAME}-checkpoints-rwx-nfs" in message


@pytest.mark.parametrize(
    "redis",
    [{"maxmemory": "3gb"}, {"port": 6380}, {"appendfsync": "always"}, {"extraConfig": "hz 20"}],
)
def test_any_change_of_the_redis_config_restarts_redis(redis: dict[str, Any]) -> None:
    before, after = _upgrade({}, {"redis": redis})
    assert f"StatefulSet/{FULLNAME}-redis" in restarted(before, after)


def test_a_new_job_restarts_every_kuberl_workload_and_not_redis() -> None:
    assert restarted(*_upgrade(*UPGRADES["a new job"])) == KUBERL_WORKLOADS


def test_more_rollout_replicas_restart_nothing() -> None:
    assert restarted(*_upgrade(*UPGRADES["more rollout replicas"])) == set()


def test_the_check_reports_what_kubernetes_refuses() -> None:
    """The helper itself, on changes the API server does refuse."""
    before = render("defaults", trainer={"checkpoints": {"size": "400Gi"}})
    after = render("defaults", redis={"persistence": {"size": "16Gi"}})
    assert sorted(str(r).split(":")[0] for r in refused_changes(before, after)) == [
        f"PersistentVolumeClaim/{FULLNAME}-checkpoints spec.resources.requests.storage (shrunk)",
        f"StatefulSet/{FULLNAME}-redis spec.volumeClaimTemplates",
    ]


# --- Autoscaling taking over the rollout Deployment's replicas --------------------------------
# The chart keeps the live Deployment's `replicas` (found with Helm's `lookup`) when autoscaling
# is on. `lookup` sees no cluster offline, so a wrapper chart hands kuberl's named template a
# live Deployment, the one the "before" render would have created; the real Helm engine
# renders both.


def _replicas_with_autoscaling(live: dict[str, Any] | None, tmp_path: Path) -> str:
    wrapper = tmp_path / "wrapper"
    (wrapper / "templates").mkdir(parents=True)
    shutil.copytree(CHART, wrapper / "charts" / "kuberl")
    (wrapper / "Chart.yaml").write_text("apiVersion: v2\nname: wrapper\nversion: 0.0.1\n")
    (wrapper / "templates" / "replicas.yaml").write_text(
        '{{- $root := dict "Values" .Values.kuberl }}\n'
        'replicas: {{ include "kuberl.rolloutReplicas" (dict "root" $root "live" .Values.live)'
        " | quote }}\n"
    )
    values = {"kuberl": {"rollout": {"autoscaling": {"enabled": True}}}, "live": live}
    with helm.Chart.load(wrapper) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_upgrade=True)
    return str(yaml.safe_load(out["wrapper/templates/replicas.yaml"])["replicas"])


def test_turning_autoscaling_on_keeps_the_replicas_the_deployment_runs(tmp_path: Path) -> None:
    live = render("defaults", rollout={"replicas": 4}).get("Deployment", "rollout")
    assert _replicas_with_autoscaling(live, tmp_path) == "4"


def test_an_autoscaler_scaled_to_zero_stays_at_zero_across_an_upgrade(tmp_path: Path) -> None:
    live = render("defaults", rollout={"replicas": 4}).get("Deployment", "rollout")
    live = {**live, "spec": {**live["spec"], "replicas": 0}}
    assert _replicas_with_autoscaling(live, tmp_path) == "0"


def test_without_a_live_deployment_the_autoscaler_sets_the_replicas(tmp_path: Path) -> None:
    rendered = render("autoscaling-hpa").get("Deployment", "rollout")
    assert (_replicas_with_autoscaling(None, tmp_path), "replicas" in rendered["spec"]) == (
        "",
        False,
    )
