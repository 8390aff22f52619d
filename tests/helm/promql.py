"""The PromQL the chart ships (dashboard panels, alert rules, the autoscaling query) and the metric
names the services define, for tests that check one against the other.

Metric names are found in the services' source with `ast`: every string literal starting with
`kuberl_`, f-strings included (`f"kuberl_{service}_rpc_seconds"`, or `f"{p}_version"` after
`p = "kuberl_weight_sync"` in the same file), whose placeholders become wildcards.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

from tests.helm.chart import CHART
from tests.support import REPO

METRIC = re.compile(r"\bkuberl_[a-z0-9_]+\b")
# SGLang's own metrics (its /metrics with --enable-metrics), in the rollout dashboard.
SGLANG_METRIC = re.compile(r"\bsglang:[A-Za-z0-9_:]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Grafana's built-in variables, replaced the way Grafana would for a query over the last minutes.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}


def _file_constants(tree: ast.AST) -> dict[str, str]:
    found = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            found[node.targets[0].id] = node.value.value
    return found


def _pattern(node: ast.AST, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(re.escape(str(value.value)))
            elif (
                isinstance(value, ast.FormattedValue)
                and isinstance(value.value, ast.Name)
                and value.value.id in constants
            ):
                parts.append(re.escape(constants[value.value.id]))
            else:
                parts.append("[a-z0-9_]+")
        return "".join(parts)
    return None


def defined_metric_patterns(root: Path = REPO / "services") -> list[re.Pattern[str]]:
    """Regexes of every metric name a service may export."""
    patterns = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        constants = _file_constants(tree)
        for node in ast.walk(tree):
            pattern = _pattern(node, constants)
            if pattern and pattern.startswith("kuberl_") and not pattern.endswith("_"):
                patterns.add(pattern)
    return [re.compile(p) for p in sorted(patterns)]


def metric_is_defined(name: str, patterns: list[re.Pattern[str]]) -> bool:
    candidates = {name} | {name.removesuffix(s) for s in HISTOGRAM_SUFFIXES if name.endswith(s)}
    return any(p.fullmatch(c) for p in patterns for c in candidates)


def dashboards() -> dict[str, dict[str, Any]]:
    return {
        p.stem: json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))
    }


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel with queries, rows' collapsed children included."""
    found = []
    for panel in board["panels"]:
        found += panel.get("panels", [])
        if panel.get("type") != "row":
            found.append(panel)
    return found


def panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) of every dashboard query."""
    return [
        (name, panel["title"], target["expr"])
        for name, board in dashboards().items()
        for panel in panels(board)
        for target in panel.get("targets", [])
    ]


def substitute(expr: str, namespace: str) -> str:
    """A dashboard query as Grafana would send it, for one namespace."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr.replace("$namespace", namespace)


def as_series_query(expr: str) -> str:
    """An alert expression with its final comparison made `bool`, so it returns its series
    whether or not the alert condition holds (`x == 0` -> `x == bool 0`)."""
    match = re.search(r"\s(==|!=|>=|<=|>|<)\s+(-?[0-9.]+)\s*$", expr)
    if not match:
        raise ValueError(f"alert expression does not end in a comparison with a number: {expr}")
    return f"{expr[: match.start()]} {match.group(1)} bool {match.group(2)}"


def is_sglang_query(expr: str) -> bool:
    """A query on SGLang's own metrics, which no local run produces (SGLang needs a GPU)."""
    return bool(SGLANG_METRIC.search(expr))


def sglang_metric_names(sglang_package: Path) -> set[str]:
    """Every metric name SGLang defines: the `name="sglang:..."` literals of its collectors."""
    source = (sglang_package / "srt" / "observability" / "metrics_collector.py").read_text()
    return set(re.findall(r'name="(sglang:[A-Za-z0-9_:]+)"', source))
