"""What a `helm upgrade` from one render of the chart to another would do to a cluster, for tests
of upgrade paths: the changes Kubernetes refuses (immutable fields), and the workloads whose pods
it restarts (a changed pod template, checksum annotations included).

The immutable fields are Kubernetes' own rules (apps/v1 and core/v1 validation): a
PersistentVolumeClaim's spec except a larger storage request, every StatefulSet spec field but
replicas, template, updateStrategy, minReadySeconds, ordinals and the claim retention policy,
a Deployment's selector, a Job's selector and pod template, a Service's clusterIP, a
PriorityClass' value. A resource that keeps its kind and name is the same object to Helm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.helm.chart import Rendered

# StatefulSet spec fields an update may change (everything else is forbidden).
STATEFULSET_MUTABLE = {
    "replicas",
    "template",
    "updateStrategy",
    "minReadySeconds",
    "ordinals",
    "persistentVolumeClaimRetentionPolicy",
}
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


@dataclass(frozen=True)
class Refused:
    """One change the API server would refuse: `kind/name field: before -> after`."""

    kind: str
    name: str
    field: str
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"{self.kind}/{self.name} {self.field}: {self.before!r} -> {self.after!r}"


def _by_identity(rendered: Rendered) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in rendered.docs}


def _storage_bytes(quantity: Any) -> int:
    text = str(quantity)
    for unit, factor in _UNITS.items():
        if text.endswith(unit):
            return int(text.removesuffix(unit)) * factor
    return int(text)


def _immutable_fields(kind: str, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Paths of the fields Kubernetes refuses to change between these two objects."""
    old, new = before.get("spec", {}), after.get("spec", {})
    changed = []
    if kind == "PersistentVolumeClaim":
        for key in (old.keys() | new.keys()) - {"resources"}:
            if old.get(key) != new.get(key):
                changed.append(f"spec.{key}")
        size = [
            _storage_bytes(s.get("resources", {}).get("requests", {}).get("storage", 0))
            for s in (old, new)
        ]
        if size[1] < size[0]:
            changed.append("spec.resources.requests.storage (shrunk)")
    elif kind == "StatefulSet":
        for key in (old.keys() | new.keys()) - STATEFULSET_MUTABLE:
            if old.get(key) != new.get(key):
                changed.append(f"spec.{key}")
    elif kind == "Deployment":
        if old.get("selector") != new.get("selector"):
            changed.append("spec.selector")
    elif kind == "Job":
        for key in ("selector", "template", "completions", "completionMode"):
            if old.get(key) != new.get(key):
                changed.append(f"spec.{key}")
    elif kind == "Service":
        if old.get("clusterIP") != new.get("clusterIP"):
            changed.append("spec.clusterIP")
    elif kind == "PriorityClass":
        if before.get("value") != after.get("value"):
            changed.append("value")
    return changed


def _at(doc: dict[str, Any], path: str) -> Any:
    value: Any = doc
    for key in path.split(" ")[0].split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def refused_changes(before: Rendered, after: Rendered) -> list[Refused]:
    """Every change from `before` to `after` that Kubernetes would refuse, failing the upgrade."""
    old, new = _by_identity(before), _by_identity(after)
    refused = []
    for identity in sorted(old.keys() & new.keys()):
        for field in _immutable_fields(identity[0], old[identity], new[identity]):
            refused.append(
                Refused(*identity, field, _at(old[identity], field), _at(new[identity], field))
            )
    return refused


def restarted(before: Rendered, after: Rendered) -> set[str]:
    """`kind/name` of every workload kept by the upgrade whose pod template changes (its pods
    are replaced)."""
    old, new = _by_identity(before), _by_identity(after)
    return {
        f"{kind}/{name}"
        for kind, name in old.keys() & new.keys()
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job")
        and old[kind, name]["spec"]["template"] != new[kind, name]["spec"]["template"]
    }
