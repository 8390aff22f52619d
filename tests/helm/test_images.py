"""The images the chart pulls: by default the three kuberl images from the registry the release
workflow pushes to (`ghcr.io/kuberl`, tagged with the chart's appVersion), and a fork's or a
mirror's registry when `images.*.registry` names one."""

from __future__ import annotations

import yaml

from tests.helm.chart import CHART, pod_spec, render, workloads


def _images(rendered) -> set[str]:
    return {
        c["image"]
        for doc in workloads(rendered)
        for c in pod_spec(doc).get("initContainers", []) + pod_spec(doc)["containers"]
    }


def test_the_default_images_come_from_the_projects_registry_at_the_app_version() -> None:
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    kuberl_images = {i for i in _images(render("defaults")) if "redis" not in i}
    assert kuberl_images == {
        f"ghcr.io/kuberl/kuberl:{version}",
        f"ghcr.io/kuberl/kuberl-rollout:{version}",
        f"ghcr.io/kuberl/kuberl-trainer:{version}",
    }


def test_a_mirror_replaces_the_registry_and_keeps_the_repositories() -> None:
    mirror = {"registry": "registry.internal/ml"}
    rendered = render(
        "defaults",
        images={"kuberl": mirror, "rollout": mirror, "trainer": {**mirror, "tag": "dev"}},
    )
    kuberl_images = {i.rsplit(":", 1)[0] for i in _images(rendered) if "redis" not in i}
    assert kuberl_images == {
        "registry.internal/ml/kuberl",
        "registry.internal/ml/kuberl-rollout",
        "registry.internal/ml/kuberl-trainer",
    }
