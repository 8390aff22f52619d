"""The rendered NetworkPolicies allow exactly kuberl's documented paths (docs/kubernetes.md),
checked by evaluating them the way the Kubernetes NetworkPolicy semantics define: a connection
passes when the source's egress and the destination's ingress both allow it (a pod no policy
selects allows everything in that direction)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.helm.chart import NAMESPACE, render

COMPONENTS = ("buffer", "reward", "weight-sync", "rollout", "trainer", "redis", "test")
PORTS = {
    "buffer": 50051,
    "reward": 50052,
    "weight-sync": 50053,
    "trainer": 50054,
    "rollout": 50060,
    "redis": 6379,
}
METRICS = {"buffer": 9101, "reward": 9102, "weight-sync": 9103, "trainer": 9104, "rollout": 9110}
NCCL_PORT = 41234  # any port: NCCL and the torchrun store pick theirs at run time

# (source, destination, port) of every documented path.
DOCUMENTED = {
    ("rollout", "buffer", 50051),
    ("trainer", "buffer", 50051),
    ("rollout", "reward", 50052),
    ("rollout", "weight-sync", 50053),
    ("trainer", "weight-sync", 50053),
    ("weight-sync", "rollout", 50060),
    ("buffer", "redis", 6379),
    # The broadcast groups weight-sync relays versions over (gloo/NCCL, weight-sync is rank 0),
    # the trainer's torchrun store and collectives: ports picked at run time, all open.
    *{
        (a, b, port)
        for a, b in (("weight-sync", "rollout"), ("rollout", "weight-sync"), ("trainer", "trainer"))
        for port in (NCCL_PORT, 29500, 6379, PORTS[b])
    },
    # helm test
    *{("test", c, PORTS[c]) for c in ("buffer", "reward", "weight-sync", "trainer", "rollout")},
}


def _labels(component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kuberl",
        "app.kubernetes.io/instance": "rl",
        "app.kubernetes.io/component": component,
    }


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer_matches(peer: dict[str, Any], labels: dict[str, str] | None) -> bool:
    """labels None = a pod of another namespace (e.g. Prometheus)."""
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        return (
            peer["namespaceSelector"] == {}
            and (labels is not None or "podSelector" not in peer)
            and (labels is None or _selects(peer.get("podSelector", {}), labels))
        )
    return labels is not None and _selects(peer["podSelector"], labels)


def _rule_allows(
    rule: dict[str, Any], peer_key: str, labels: dict[str, str] | None, port: int
) -> bool:
    peers = rule.get(peer_key)
    ports = rule.get("ports")
    peer_ok = peers is None or any(_peer_matches(p, labels) for p in peers)
    port_ok = ports is None or any(p.get("port") in (None, port) for p in ports)
    return peer_ok and port_ok


def _allowed(policies: list[dict[str, Any]], src: str | None, dst: str | None, port: int) -> bool:
    src_labels = _labels(src) if src else None
    dst_labels = _labels(dst) if dst else None

    def side(labels, direction, key, other):
        if labels is None:
            return True  # outside the release: not governed by its policies
        selecting = [
            p["spec"]
            for p in policies
            if _selects(p["spec"]["podSelector"], labels) and direction in p["spec"]["policyTypes"]
        ]
        if not selecting:
            return True
        rules = [r for spec in selecting for r in spec.get(direction.lower(), [])]
        return any(_rule_allows(r, key, other, port) for r in rules)

    return side(src_labels, "Egress", "to", dst_labels) and side(
        dst_labels, "Ingress", "from", src_labels
    )


@pytest.fixture(scope="module")
def policies() -> list[dict[str, Any]]:
    docs = render("defaults").all("NetworkPolicy")
    assert {d["metadata"]["namespace"] for d in docs} == {NAMESPACE}
    return docs


def test_exactly_the_documented_paths_are_open_between_components(policies) -> None:
    open_paths = {
        (src, dst, port)
        for src in COMPONENTS
        for dst in COMPONENTS
        for port in {PORTS.get(dst, 1), NCCL_PORT, 29500, 6379}
        if dst != "test" and _allowed(policies, src, dst, port)
    }
    assert open_paths == DOCUMENTED


def test_metrics_ports_are_open_to_scrapers_in_other_namespaces(policies) -> None:
    scraped = {c: _allowed(policies, None, c, port) for c, port in METRICS.items()}
    grpc_from_outside = {c: _allowed(policies, None, c, PORTS[c]) for c in METRICS}
    assert set(scraped.values()) == {True} and set(grpc_from_outside.values()) == {False}


def test_every_component_may_resolve_names(policies) -> None:
    dns = {c: _allowed(policies, c, None, 53) for c in COMPONENTS if c != "redis"}
    assert set(dns.values()) == {True}


def test_external_redis_is_reachable_only_from_the_buffer() -> None:
    docs = render("external-redis").all("NetworkPolicy")
    reach = {c: _allowed(docs, c, None, 6380) for c in COMPONENTS if c != "redis"}
    assert reach == {c: c == "buffer" for c in reach}


def test_extra_egress_opens_only_the_component_it_names() -> None:
    hub = [{"ports": [{"protocol": "TCP", "port": 443}]}]
    docs = render("defaults", networkPolicy={"extraEgress": {"rollout": hub}}).all("NetworkPolicy")
    reach = {c: _allowed(docs, c, None, 443) for c in ("rollout", "trainer", "reward")}
    assert reach == {"rollout": True, "trainer": False, "reward": False}


def test_sglangs_port_is_open_to_scrapers_only_while_its_metrics_are_on(policies) -> None:
    closed = render("defaults", rollout={"sglang": {"metrics": False}}).all("NetworkPolicy")
    assert (
        _allowed(policies, None, "rollout", 30000),
        _allowed(closed, None, "rollout", 30000),
    ) == (
        True,
        False,
    )


PEER_PORT = 50061


def test_the_weight_relay_port_is_open_between_rollout_pods_only_with_the_relay_on(
    policies,
) -> None:
    relay = render("defaults", job={"weight_sync": {"relay_fanout": 2}}).all("NetworkPolicy")
    reach = {
        (src, port): _allowed(relay, src, "rollout", port)
        for src in ("rollout", "trainer", "buffer", "reward")
        for port in (PEER_PORT, PEER_PORT + 1)
    }
    assert (reach, _allowed(policies, "rollout", "rollout", PEER_PORT)) == (
        {(src, port): src == "rollout" and port == PEER_PORT for src, port in reach},
        False,
    )


def test_the_job_file_pins_the_replicas_relay_port_the_policy_opens() -> None:
    cm = render("defaults", rollout={"peerPort": 50071}).get("ConfigMap", "job")
    assert yaml.safe_load(cm["data"]["job.yaml"])["rollout"]["peer_port"] == 50071
