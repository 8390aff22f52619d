"""values.schema.json: its job section is generated from the job models and in sync with them, and
the real Helm engine uses it to reject wrong values before anything is rendered."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kuberl.common.config import BufferConfig, JobConfig, parse_job_config
from kuberl.common.schema import DEFAULT_PATH, regenerate, render_values_schema
from tests.helm.chart import CHART, render_values, values_yaml
from tests.support import REPO

helm = pytest.importorskip("helm_python", reason="helm-python-sdk not installed")


def _helm_rejects(values: dict[str, Any]) -> str:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as err:
        chart.validate_schema(values)
    return str(err.value)


def test_the_committed_schema_is_in_sync_with_the_job_models() -> None:
    on_disk, expected = regenerate(REPO / DEFAULT_PATH)
    assert on_disk == expected, (
        "helm/kuberl/values.schema.json is out of date with kuberl.common.config: run "
        "`.venv/bin/kuberl chart schema` and commit the result"
    )


def test_kuberl_chart_schema_check_reports_a_stale_file(tmp_path) -> None:
    stale = json.loads((CHART / "values.schema.json").read_text())
    stale["properties"]["job"] = {"type": "object"}
    path = tmp_path / "values.schema.json"
    path.write_text(json.dumps(stale))
    cmd = [sys.executable, "-m", "kuberl.cli", "chart", "schema", "--path", str(path)]
    check = subprocess.run([*cmd, "--check"], capture_output=True, text=True, cwd=REPO)
    fix = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    recheck = subprocess.run([*cmd, "--check"], capture_output=True, text=True, cwd=REPO)
    assert (check.returncode, fix.returncode, recheck.returncode) == (1, 0, 0)


def test_kuberl_chart_schema_on_a_missing_file_says_so_without_a_traceback(tmp_path) -> None:
    cmd = [sys.executable, "-m", "kuberl.cli", "chart", "schema", "--check"]
    done = subprocess.run(
        [*cmd, "--path", str(tmp_path / "none.json")], capture_output=True, text=True, cwd=REPO
    )
    assert (done.returncode, "Traceback" in done.stderr) == (2, False), done.stderr


def test_the_job_section_is_the_job_models_schema() -> None:
    schema = render_values_schema(json.loads((CHART / "values.schema.json").read_text()))
    job = schema["properties"]["job"]
    assert set(job["properties"]) == set(JobConfig.model_fields)
    assert job["additionalProperties"] is False


def test_the_default_job_is_accepted_by_the_services_own_loader() -> None:
    config = parse_job_config(values_yaml()["job"], env={})
    assert config.job.name == "kuberl"


def test_the_chart_default_max_inflight_matches_the_buffer_model() -> None:
    # rollout-autoscaling.yaml falls back to 64 when job.buffer.max_inflight_groups is unset.
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    default = BufferConfig.model_fields["max_inflight_groups"].default
    assert f'"max_inflight_groups" {default} ' in helpers


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"buffer": {"replicas": -1}}, "/buffer/replicas"),
        ({"reward": {"replicas": "two"}}, "/reward/replicas"),
        ({"trainer": {"nodes": 0}}, "/trainer/nodes"),
        ({"rollout": {"sglang": {"memFractionStatic": 1.5}}}, "/rollout/sglang/memFractionStatic"),
        ({"rollout": {"autoscaling": {"engine": "vpa"}}}, "/rollout/autoscaling/engine"),
        ({"redis": {"appendfsync": "sometimes"}}, "/redis/appendfsync"),
        ({"replicas": 3}, "additional properties 'replicas'"),
        ({"job": {"trainer": {"zero_stage": 4}}}, "/job/trainer/zero_stage"),
        ({"job": {"trainer": {"optimizer": {"lr": "fast"}}}}, "/job/trainer/optimizer/lr"),
        ({"job": {"rollout": {"group_size": 0}}}, "/job/rollout/group_size"),
        ({"job": {"buffer": {"max_inflight": 8}}}, "additional properties 'max_inflight'"),
        ({"job": {"job": {"name": "Not_A_DNS_Label"}}}, "/job/job/name"),
    ],
)
def test_helm_rejects_wrong_values_and_names_the_field(values, complaint) -> None:
    assert complaint in _helm_rejects(values)


def test_helm_accepts_every_tested_value_set() -> None:
    from tests.helm.chart import VALUE_SETS

    with helm.Chart.load(CHART) as chart:
        for values in VALUE_SETS.values():
            chart.validate_schema(values)


def test_a_wrong_job_fails_the_install_not_the_pods() -> None:
    with pytest.raises(helm.HelmValuesError):
        render_values({"job": {"reward": {"timeout_seconds": -1}}})
