"""SGLang's own Prometheus metrics: launched with `--enable-metrics` and scraped on its port by
the ServiceMonitor or the PodMonitor (the panels that show them: tests/helm/test_dashboards.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helm.chart import pod_spec, render


def _sglang(value_set: str, **overrides: Any) -> dict[str, Any]:
    rollout = render(value_set, **overrides).get("Deployment", "rollout")
    return next(c for c in pod_spec(rollout)["containers"] if c["name"] == "sglang")


def test_sglang_is_launched_with_its_metrics_on_by_default() -> None:
    off = _sglang("defaults", rollout={"sglang": {"metrics": False}})
    assert (
        "--enable-metrics" in _sglang("defaults")["args"],
        "--enable-metrics" in off["args"],
    ) == (
        True,
        False,
    )


def test_the_service_monitor_scrapes_sglang_on_a_port_of_the_rollout_service() -> None:
    rendered = render("monitoring")
    (monitor,) = rendered.all("ServiceMonitor")
    service_ports = {p["name"]: p for p in rendered.get("Service", "rollout")["spec"]["ports"]}
    sglang = next(e for e in monitor["spec"]["endpoints"] if e["port"] == "sglang")
    container_ports = {p["name"] for p in _sglang("monitoring")["ports"]}
    assert (sglang["path"], service_ports["sglang"]["targetPort"]) == ("/metrics", "sglang")
    assert "sglang" in container_ports


def test_the_pod_monitor_scrapes_the_sglang_container_port() -> None:
    (monitor,) = render("monitoring-pods").all("PodMonitor")
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert ports == {"metrics", "sglang"}


@pytest.mark.parametrize("value_set", ["monitoring", "monitoring-pods"])
def test_without_sglang_metrics_nothing_scrapes_its_port(value_set: str) -> None:
    rendered = render(value_set, rollout={"sglang": {"metrics": False}})
    monitors = rendered.all("ServiceMonitor") + rendered.all("PodMonitor")
    endpoints = [
        e["port"]
        for m in monitors
        for e in m["spec"].get("endpoints", []) + m["spec"].get("podMetricsEndpoints", [])
    ]
    service_ports = {p["name"] for p in rendered.get("Service", "rollout")["spec"]["ports"]}
    assert ("sglang" in endpoints, "sglang" in service_ports) == (False, False)
