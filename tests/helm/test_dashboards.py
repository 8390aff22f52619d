"""Grafana dashboards and alert rules, statically: valid dashboard JSON a Grafana sidecar can load,
every query on a metric the services really define, alert expressions Prometheus accepts."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helm.chart import NAMESPACE, render, render_values, sglang_package
from tests.helm.promql import (
    METRIC,
    SGLANG_METRIC,
    dashboards,
    defined_metric_patterns,
    is_sglang_query,
    metric_is_defined,
    panel_queries,
    panels,
    sglang_metric_names,
    substitute,
)

EXPECTED = {"buffer", "job-overview", "reward", "rollout", "weight-sync"}


def _rules() -> list[dict]:
    rule = render("monitoring").all("PrometheusRule")[0]
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def test_the_chart_ships_the_five_dashboards() -> None:
    assert set(dashboards()) == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dashboard_is_loadable_by_grafana(name: str) -> None:
    board = dashboards()[name]
    ids = [p["id"] for p in board["panels"]] + [
        c["id"] for p in board["panels"] for c in p.get("panels", [])
    ]
    variables = {v["name"]: v["type"] for v in board["templating"]["list"]}
    assert board["uid"] == f"kuberl-{name}" and len(board["uid"]) <= 40
    assert len(ids) == len(set(ids))
    assert variables == {"datasource": "datasource", "namespace": "query"}
    for panel in panels(board):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
        assert panel.get("description"), f"{name}/{panel['title']} has no description"


def test_dashboard_uids_are_unique() -> None:
    uids = [b["uid"] for b in dashboards().values()]
    assert len(uids) == len(set(uids))


def test_every_dashboard_query_is_scoped_to_the_selected_namespace() -> None:
    unscoped = [
        (board, title)
        for board, title, expr in panel_queries()
        if len(METRIC.findall(expr) + SGLANG_METRIC.findall(expr))
        != expr.count('namespace=~"$namespace"')
    ]
    assert unscoped == []


def test_every_metric_in_dashboards_and_alerts_is_defined_by_a_service() -> None:
    patterns = defined_metric_patterns()
    exprs = [expr for _, _, expr in panel_queries()] + [r["expr"] for r in _rules()]
    keda = render("autoscaling-keda").all("ScaledObject")[0]
    exprs.append(keda["spec"]["triggers"][0]["metadata"]["query"])
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert used and sorted(n for n in used if not metric_is_defined(n, patterns)) == []


def test_the_rollout_dashboard_shows_sglangs_throughput_queue_and_cache() -> None:
    sglang_panels = [p for p in panels(dashboards()["rollout"]) if p["title"].startswith("SGLang")]
    used = {
        n for p in sglang_panels for t in p["targets"] for n in SGLANG_METRIC.findall(t["expr"])
    }
    assert {
        "sglang:generation_tokens_total",
        "sglang:num_queue_reqs",
        "sglang:cached_tokens_total",
        "sglang:prompt_tokens_total",
    } <= used


def test_every_sglang_metric_in_the_dashboards_is_one_sglang_defines() -> None:
    """SGLang cannot run here (it needs a GPU), so its panels' names are checked against its
    own source: sglang/srt/observability/metrics_collector.py of SGLang 0.5.23."""
    package = sglang_package()
    if package is None:
        pytest.skip("sglang not installed (make setup adds it)")
    defined = sglang_metric_names(package)
    used = {name for _, _, expr in panel_queries() for name in SGLANG_METRIC.findall(expr)}
    unknown = [
        name
        for name in sorted(used)
        if not any(name.removesuffix(s) in defined for s in ("_bucket", "_sum", "_count", ""))
    ]
    assert len(defined) > 50 and used and unknown == []


def test_promtool_accepts_the_sglang_panel_queries(tmp_path: Path) -> None:
    """The PromQL of the panels no local run can feed (SGLang's), parsed by Prometheus' own
    promtool as recording rules, as Grafana would send them for one namespace."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    exprs = [substitute(e, NAMESPACE) for _, _, e in panel_queries() if is_sglang_query(e)]
    rules = [{"record": f"kuberl:sglang_panel_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "sglang.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "sglang-panels", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert len(exprs) >= 5 and result.returncode == 0, result.stdout + result.stderr


def test_each_release_renders_its_own_dashboard_uids_and_titles() -> None:
    def boards(release: str) -> dict[str, tuple[str, str]]:
        maps = [
            d
            for d in render_values({}, release=release).all("ConfigMap")
            if "dashboard" in d["metadata"]["name"]
        ]
        return {
            b["uid"]: (b["title"], b["templating"]["list"][1]["current"]["value"])
            for b in (json.loads(next(iter(m["data"].values()))) for m in maps)
        }

    first, again, second = boards("rl"), boards("rl"), boards("rl-2")
    assert first == again and len(first) == 5
    assert first.keys().isdisjoint(second.keys()) and all(len(uid) <= 40 for uid in first)
    titles = {title for title, _ in first.values()} | {title for title, _ in second.values()}
    assert len(titles) == 10 and {ns for _, ns in first.values()} == {NAMESPACE}


def test_the_metric_check_knows_a_name_that_does_not_exist() -> None:
    patterns = defined_metric_patterns()
    assert (
        metric_is_defined("kuberl_buffer_groups_pending", patterns),
        metric_is_defined("kuberl_buffer_rpc_seconds_bucket", patterns),
        metric_is_defined("kuberl_buffer_groups_pendng", patterns),
    ) == (True, True, False)


def test_alert_rules_cover_the_four_failure_modes() -> None:
    names = {r["alert"] for r in _rules()}
    assert names == {
        "KuberlRolloutStalled",
        "KuberlBufferBacklogGrowing",
        "KuberlTrainerNotStepping",
        "KuberlWeightSyncLagging",
    }
    assert all(f'namespace="{NAMESPACE}"' in r["expr"] for r in _rules())


def test_promtool_accepts_the_alert_rules(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    rule = render("monitoring").all("PrometheusRule")[0]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_fire_on_a_stalled_job_and_stay_quiet_on_a_healthy_one(tmp_path: Path) -> None:
    """Prometheus' own rule engine (`promtool test rules`) on synthetic series: a job that stops
    generating, stepping and updating its engines, with a growing backlog, fires all four alerts;
    a healthy one fires none."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    rule = render("monitoring").all("PrometheusRule")[0]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    ns = f'namespace="{NAMESPACE}"'

    def series(name: str, values: str, labels: str = "") -> dict[str, str]:
        return {"series": f"{name}{{{ns}{labels}}}", "values": values}

    # One sample a minute for 40 minutes. Stalled: counters flat, backlog growing, engine at v5
    # while the trainer is at v10. Healthy: everything moving, engine current.
    stalled = [
        series("kuberl_rollout_generated_tokens_total", "1000+0x40", ',kind="train"'),
        series("kuberl_trainer_steps_total", "50+0x40", ',mode="rl"'),
        series("kuberl_buffer_groups_pending", "0+1x40", ',kind="train"'),
        series("kuberl_trainer_policy_version", "10+0x40"),
        series("kuberl_weight_sync_version", "10+0x40"),
        series("kuberl_rollout_engine_version", "5+0x40"),
    ]
    healthy = [
        series("kuberl_rollout_generated_tokens_total", "0+500x40", ',kind="train"'),
        series("kuberl_trainer_steps_total", "0+1x40", ',mode="rl"'),
        series("kuberl_buffer_groups_pending", "4+0x40", ',kind="train"'),
        # publish_every 3: the trainer runs ahead of what is published; one replica is still
        # starting (SGLang loading) at version 0. Neither is lag.
        series("kuberl_trainer_policy_version", "0+3x40"),
        series("kuberl_weight_sync_version", "0+1x40"),
        series("kuberl_rollout_engine_version", "0+1x40", ',pod="rollout-a"'),
        series("kuberl_rollout_engine_version", "0+0x40", ',pod="rollout-b"'),
    ]
    alerts = [
        "KuberlRolloutStalled",
        "KuberlBufferBacklogGrowing",
        "KuberlTrainerNotStepping",
        "KuberlWeightSyncLagging",
    ]

    rules = {r["alert"]: r for r in _rules()}

    def case(input_series: list[dict[str, str]], firing: bool) -> dict:
        expected = {
            name: [
                {"exp_labels": rules[name]["labels"], "exp_annotations": rules[name]["annotations"]}
            ]
            for name in alerts
        }
        return {
            "interval": "1m",
            "input_series": input_series,
            "alert_rule_test": [
                {
                    "eval_time": "40m",
                    "alertname": name,
                    "exp_alerts": expected[name] if firing else [],
                }
                for name in alerts
            ],
        }

    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump(
            {"rule_files": ["rules.yaml"], "tests": [case(stalled, True), case(healthy, False)]}
        )
    )
    result = subprocess.run(
        [promtool, "test", "rules", "tests.yaml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
