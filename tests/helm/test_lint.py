"""Helm lint (strict, for the oldest supported Kubernetes) on every value set, and the chart's own
conventions: every value documented with a `# --` comment, apiVersion v2, a test hook."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.helm.chart import CHART, VALUE_SETS, render

helm = pytest.importorskip("helm_python", reason="helm-python-sdk not installed")

WARNING = 2


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_helm_lint_strict_finds_no_warning_or_error(value_set: str) -> None:
    report = helm.lint(CHART, VALUE_SETS[value_set], strict=True, kube_version="v1.29.0")
    problems = [m for m in report["messages"] if m["severity"] >= WARNING] + report["errors"]
    assert problems == []


def test_chart_is_a_helm3_application_chart() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (meta["apiVersion"], meta["type"], meta["kubeVersion"]) == (
        "v2",
        "application",
        ">=1.29.0-0",
    )


def _leaf_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [
            p for k, v in node.items() for p in _leaf_paths(v, f"{prefix}.{k}" if prefix else k)
        ]
    return [prefix]


def _documented_keys(text: str) -> set[str]:
    """Dotted paths of keys preceded by a `# --` comment block (helm-docs convention)."""
    documented: set[str] = set()
    stack: list[tuple[int, str]] = []
    pending = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending = True
            continue
        if stripped.startswith("#") or not stripped:
            continue
        match = re.match(r"^(\s*)([A-Za-z0-9_.-]+):", line)
        if not match:
            continue  # a list item or a continuation
        indent, key = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [key])
        stack.append((indent, key))
        if pending:
            documented.add(path)
        pending = False
    return documented


def test_every_value_is_documented_with_a_helm_docs_comment() -> None:
    text = (CHART / "values.yaml").read_text()
    documented = _documented_keys(text)
    values = yaml.safe_load(text)
    # A value is documented when it, or a section above it, carries a `# --` comment
    # (a documented map such as `podSecurityContext` documents its keys).
    undocumented = [
        path
        for path in _leaf_paths(values)
        if not any(path == d or path.startswith(d + ".") for d in documented)
    ]
    assert undocumented == []


def test_the_helm_test_hook_checks_every_grpc_service() -> None:
    pod = next(
        d
        for d in render("defaults").all("Pod")
        if d["metadata"]["annotations"].get("helm.sh/hook") == "test"
    )
    args = pod["spec"]["containers"][0]["args"]
    ports = sorted(int(a.rsplit(":", 1)[1]) for a in args if re.search(r":\d+$", a))
    assert (args[0], ports) == ("health", [50051, 50052, 50053, 50054, 50060])
