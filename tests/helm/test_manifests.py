"""The chart renders with the real Helm engine for every supported value set, and every manifest it
produces validates: built-in kinds with kubernetes-validate --strict for the oldest supported and
the newest known Kubernetes, custom resources against the models of their CRDs."""

from __future__ import annotations

import pytest

from tests.helm.chart import (
    CUSTOM_KINDS,
    KUBE_VERSIONS,
    VALUE_SETS,
    kubernetes_validate,
    render,
    validate_custom,
)

pytest.importorskip("kubernetes_validate.utils", reason="kubernetes-validate not installed")
kv = kubernetes_validate()


def _version(name: str) -> str:
    return kv.latest_version() if name == "latest" else name


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_builtin_manifest_validates_strictly(value_set: str, kube: str) -> None:
    problems = []
    for doc in render(value_set).docs:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            continue
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kv.validate(doc, _version(kube), strict=True)
        except kv.ValidationError as exc:
            problems.append(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kv.SchemaNotFoundError as exc:
            problems.append(f"{where}: {exc.message}")
    assert problems == []


@pytest.mark.parametrize(
    "value_set", ["monitoring", "monitoring-pods", "autoscaling-keda", "tls-roles"]
)
def test_custom_resources_match_their_crd_models(value_set: str) -> None:
    pytest.importorskip("cloudcoil.models.keda", reason="cloudcoil CRD models not installed")
    docs = [d for d in render(value_set).docs if (d["apiVersion"], d["kind"]) in CUSTOM_KINDS]
    problems = {f"{d['kind']}/{d['metadata']['name']}": validate_custom(d) for d in docs}
    assert docs and [p for p in problems.values() if p] == []


def test_the_crd_check_rejects_a_field_the_crd_does_not_have() -> None:
    pytest.importorskip("cloudcoil.models.keda", reason="cloudcoil CRD models not installed")
    monitor = dict(render("monitoring").all("ServiceMonitor")[0])
    monitor["spec"] = {**monitor["spec"], "scrapeEvery": "5s"}
    assert validate_custom(monitor) == [
        "ServiceMonitor.spec.scrapeEvery: not a field of ServiceMonitorSpec"
    ]


def test_defaults_render_one_workload_per_component() -> None:
    rendered = render("defaults")
    workloads = {
        (d["kind"], d["metadata"]["labels"]["app.kubernetes.io/component"])
        for d in rendered.docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    assert workloads == {
        ("Deployment", "buffer"),
        ("Deployment", "reward"),
        ("Deployment", "weight-sync"),
        ("Deployment", "rollout"),
        ("StatefulSet", "trainer"),
        ("StatefulSet", "redis"),
    }


def test_monitoring_objects_are_off_by_default() -> None:
    kinds = {d["kind"] for d in render("defaults").docs}
    assert kinds.isdisjoint(
        {
            "ServiceMonitor",
            "PodMonitor",
            "PrometheusRule",
            "ScaledObject",
            "HorizontalPodAutoscaler",
        }
    )


def test_names_fit_kubernetes_limits_for_the_longest_release_name() -> None:
    from tests.helm.chart import render_values

    longest = render_values({}, release="r" * 53)  # Helm's own limit on release names
    names = [d["metadata"]["name"] for d in longest.docs]
    statefulsets = [d["metadata"]["name"] for d in longest.all("StatefulSet")]
    # Service names are DNS labels (63); a StatefulSet's pods get `<name>-<hash>` revision
    # labels, which leaves its own name 52 characters.
    assert (max(map(len, names)), max(map(len, statefulsets))) <= (63, 52)
