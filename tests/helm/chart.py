"""Rendering helm/kuberl with the real Helm engine (helm-python-sdk, Helm's Go code through its C
ABI) and validating what comes out: Kubernetes manifests with kubernetes-validate's published
OpenAPI schemas, custom resources (ServiceMonitor, PodMonitor, PrometheusRule, ScaledObject,
Certificate) with the cloudcoil models generated from the prometheus-operator, KEDA and
cert-manager CRD schemas.

The value sets below are the configurations the chart promises to support; every test in
tests/helm renders them through `render()`, which caches one render per value set.
"""

from __future__ import annotations

import copy
import functools
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support import REPO

CHART = REPO / "helm" / "kuberl"
RELEASE = "rl"
NAMESPACE = "kuberl-test"
FULLNAME = "rl-kuberl"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest one
# kubernetes-validate knows.
KUBE_VERSIONS = ("1.29.0", "latest")

_MODELS = {"persistentVolumeClaim": {"claimName": "models"}}
_DATA = {"persistentVolumeClaim": {"claimName": "datasets"}}
_TRAIN = [{"path": "/data/gsm8k/train.jsonl", "columns": {"prompt": "question"}}]


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


_GSM8K_QWEN = yaml.safe_load((REPO / "examples" / "gsm8k-qwen.yaml").read_text())


def _example_values(name: str) -> dict[str, Any]:
    """helm/kuberl/examples/<name> over examples/gsm8k-qwen.yaml as `job`, as docs/kubernetes.md
    installs it (`-f job-values.yaml -f helm/kuberl/examples/<name>`)."""
    values: dict[str, Any] = yaml.safe_load((CHART / "examples" / name).read_text())
    return _merge({"job": _GSM8K_QWEN}, values)


VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "external-redis": {
        "redis": {"enabled": False},
        "externalRedis": {
            "host": "redis.storage.svc",
            "port": 6380,
            "db": 2,
            "tls": {"enabled": True, "caSecret": "redis-ca"},
            "existingSecret": "redis-auth",
            "existingSecretPasswordKey": "password",
        },
    },
    "autoscaling-hpa": {
        "rollout": {
            "autoscaling": {"enabled": True, "engine": "hpa", "minReplicas": 2, "maxReplicas": 12}
        },
    },
    "autoscaling-keda": {
        "rollout": {
            "autoscaling": {"enabled": True, "engine": "keda", "minReplicas": 0, "maxReplicas": 6}
        },
    },
    "multi-node-trainer": {
        "trainer": {
            "nodes": 4,
            "gpusPerNode": 8,
            "checkpoints": {"accessModes": ["ReadWriteMany"], "storageClass": "nfs"},
        },
        "rollout": {"replicas": 3, "sglang": {"tpSize": 2}},
        "model": {"path": "/models/Qwen2.5-7B", "volume": _MODELS},
        "data": {"volume": _DATA},
        "job": {"data": {"train": _TRAIN}, "trainer": {"zero_stage": 3}},
    },
    "monitoring": {
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "prometheusRule": {"enabled": True},
        },
        "dashboards": {"annotations": {"grafana_folder": "kuberl"}},
    },
    # Pods scraped directly instead of through their Services (one or the other, never both).
    "monitoring-pods": {"metrics": {"podMonitor": {"enabled": True}}},
    "mutual-tls": {
        "tls": {"enabled": True, "secretName": "kuberl-grpc-tls"},
    },
    # Per-RPC roles: a certificate per component from a cert-manager ClusterIssuer, the trainer's
    # from a Secret made ahead, the rollout replicas' from cert-manager's csi-driver.
    "tls-roles": {
        "job": {"job": {"name": "gsm8k-grpo"}},
        "tls": {
            "enabled": True,
            "roles": {"enabled": True},
            "certManager": {"issuerRef": {"name": "kuberl-ca", "kind": "ClusterIssuer"}},
            "componentSecrets": {"trainer": "trainer-from-vault"},
        },
    },
    # examples/gsm8k-qwen.yaml as its header says to install it: the job file as `job`, and a
    # cluster's model and data volumes, SGLang engines and GPU trainer nodes.
    "gsm8k-qwen-example": {
        "job": _GSM8K_QWEN,
        "model": {"path": "/models/Qwen2.5-1.5B-Instruct", "volume": _MODELS},
        "data": {"volume": _DATA},
        "rollout": {"replicas": 2, "sglang": {"enabled": True}},
        "trainer": {"nodes": 1, "gpusPerNode": 4},
    },
    # examples/gsm8k-tools.yaml the same way: multi-turn tool calling with the python sandbox.
    "gsm8k-tools-example": {
        "job": yaml.safe_load((REPO / "examples" / "gsm8k-tools.yaml").read_text()),
        "model": {"path": "/models/Qwen2.5-1.5B-Instruct", "volume": _MODELS},
        "data": {"volume": _DATA},
        "rollout": {"replicas": 2, "sglang": {"enabled": True}},
        "trainer": {"nodes": 1, "gpusPerNode": 4},
    },
    # A shared GPU cluster: the NVIDIA runtime as a runtime class, a trainer PriorityClass made by
    # the chart, zone spread of the CPU services.
    "gpu-scheduling": {
        "rollout": {"runtimeClassName": "nvidia"},
        "trainer": {"runtimeClassName": "nvidia", "priorityClass": {"create": True}},
        "reward": {
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "topology.kubernetes.io/zone",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "reward"}},
                }
            ]
        },
    },
    # A model by Hugging Face id: downloaded once by a Job into the models claim, with a token.
    "hub-model": {
        "model": {
            "path": "Qwen/Qwen2.5-7B-Instruct",
            "volume": _MODELS,
            "download": {"tokenSecret": {"name": "hf-token"}, "allowEgress": True},
        },
        "data": {"volume": _DATA},
        "job": {"data": {"train": _TRAIN}},
    },
    # The two cluster values files docs/kubernetes.md installs from an empty cluster.
    "one-node-example": _example_values("values-one-node.yaml"),
    "two-trainer-nodes-example": _example_values("values-two-trainer-nodes.yaml"),
    "cpu-only": {
        "rollout": {"sglang": {"enabled": False}},
        "model": {"path": ""},
        "job": {"rollout": {"engine": {"kind": "torch", "device": "cpu"}}},
        "networkPolicy": {"enabled": False},
        "dashboards": {"enabled": False},
    },
}


@dataclass(frozen=True)
class Rendered:
    """One render of the chart: every manifest (test hooks included) and NOTES.txt."""

    docs: tuple[dict[str, Any], ...]
    notes: str

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        """The manifest of this kind named `<fullname>-<name>`."""
        full = f"{FULLNAME}-{name}" if name else FULLNAME
        found = [d for d in self.all(kind) if d["metadata"]["name"] == full]
        if len(found) != 1:
            names = [d["metadata"]["name"] for d in self.all(kind)]
            raise KeyError(f"{kind}/{full}: found {len(found)} (have {names})")
        return found[0]

    def has(self, kind: str, name: str) -> bool:
        full = f"{FULLNAME}-{name}" if name else FULLNAME
        return any(d["metadata"]["name"] == full for d in self.all(kind))


def render_values(values: dict[str, Any], release: str = RELEASE) -> Rendered:
    """Render the chart with these values (the Helm engine validates them against the schema)."""
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=release, namespace=NAMESPACE, is_install=True)
    docs: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return Rendered(tuple(docs), notes)


@functools.cache
def _render_cached(key: str) -> Rendered:
    return render_values(json.loads(key))


def render(value_set: str, **overrides: Any) -> Rendered:
    """Render a named value set, optionally with overrides merged over it (cached)."""
    values = _merge(VALUE_SETS[value_set], overrides)
    return _render_cached(json.dumps(values, sort_keys=True))


def values_yaml() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return data


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a workload or of a bare Pod."""
    if doc["kind"] == "Pod":
        spec: dict[str, Any] = doc["spec"]
        return spec
    spec = doc["spec"]["template"]["spec"]
    return spec


def workloads(rendered: Rendered) -> list[dict[str, Any]]:
    return [d for d in rendered.docs if d["kind"] in ("Deployment", "StatefulSet", "Job", "Pod")]


def kubernetes_validate() -> Any:
    """kubernetes_validate.utils with its schema files read once per process, not per manifest.

    `validate` re-reads and re-parses the 1.2 MB definitions file for every manifest; the files
    never change, so memoising the reader keeps the library's own validation and makes the
    test ~5 ms per manifest.
    """
    import kubernetes_validate.utils as kv

    if not hasattr(kv.schema_contents, "cache_info"):
        kv.schema_contents = functools.cache(kv.schema_contents)
    return kv


# --- Custom resources -------------------------------------------------------------------------

CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): (
        "cloudcoil.models.prometheus_operator.v1",
        "ServiceMonitor",
    ),
    ("monitoring.coreos.com/v1", "PodMonitor"): (
        "cloudcoil.models.prometheus_operator.v1",
        "PodMonitor",
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): (
        "cloudcoil.models.prometheus_operator.v1",
        "PrometheusRule",
    ),
    ("keda.sh/v1alpha1", "ScaledObject"): ("cloudcoil.models.keda.v1alpha1", "ScaledObject"),
    ("cert-manager.io/v1", "Certificate"): ("cloudcoil.models.cert_manager.v1", "Certificate"),
}


def _strip(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def unknown_fields(annotation: Any, value: Any, path: str) -> list[str]:
    """Fields of `value` that the model `annotation` does not declare, recursively.

    The cloudcoil models ignore unknown fields (as the API server prunes them); a field the CRD
    does not know is a silent bug in a chart, so the tests reject it like `--strict` does.
    """
    import pydantic

    annotation = _strip(annotation)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        candidates = [unknown_fields(arg, value, path) for arg in args if arg is not type(None)]
        return min(candidates, key=len) if candidates else []
    if origin in (list, typing.List) and isinstance(value, list):  # noqa: UP006
        return [
            e for i, item in enumerate(value) for e in unknown_fields(args[0], item, f"{path}[{i}]")
        ]
    if origin in (dict, typing.Dict) and isinstance(value, dict):  # noqa: UP006
        return [
            e for k, item in value.items() for e in unknown_fields(args[1], item, f"{path}.{k}")
        ]
    if isinstance(annotation, type) and issubclass(annotation, pydantic.RootModel):
        return unknown_fields(annotation.model_fields["root"].annotation, value, path)
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        if not isinstance(value, dict):
            return []
        fields = {(f.alias or name): f for name, f in annotation.model_fields.items()}
        errors = []
        for key, item in value.items():
            field = fields.get(key)
            if field is None:
                errors.append(f"{path}.{key}: not a field of {annotation.__name__}")
            else:
                errors += unknown_fields(field.annotation, item, f"{path}.{key}")
        return errors
    return []


def validate_custom(doc: dict[str, Any]) -> list[str]:
    """Problems of a custom resource against its CRD's model: type errors and unknown fields."""
    import importlib

    import pydantic

    module_name, class_name = CUSTOM_KINDS[(doc["apiVersion"], doc["kind"])]
    model = getattr(importlib.import_module(module_name), class_name)
    try:
        model.model_validate(doc)
    except pydantic.ValidationError as exc:
        return [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return unknown_fields(model, doc, doc["kind"])


def sglang_package() -> Path | None:
    """SGLang's installed source folder (make setup installs sglang==0.5.23 for its source), found
    without importing it: importing needs its CUDA dependencies."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def files_under(folder: Path, pattern: str) -> list[Path]:
    return sorted(folder.glob(pattern))
