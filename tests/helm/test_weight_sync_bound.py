"""The weight-sync volume's size limit reaches the service as its per-version bound: the chart sets
`job.weight_sync.max_version_bytes` to `weightSync.snapshotSizeLimit` / (retain_versions + 1),
parsing the Kubernetes quantity itself (docs/weight-sync.md "Upload size")."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kuberl.common.config import WeightSyncConfig
from tests.helm.chart import render, render_values

GI = 1024**3


def _weight_sync(values: dict[str, Any]) -> dict[str, Any]:
    cm = render_values(values).get("ConfigMap", "job")
    section: dict[str, Any] = yaml.safe_load(cm["data"]["job.yaml"])["weight_sync"]
    return section


def test_by_default_a_version_may_take_the_volumes_limit_shared_with_the_versions_kept() -> None:
    cm = render("defaults").get("ConfigMap", "job")
    bound = yaml.safe_load(cm["data"]["job.yaml"])["weight_sync"]["max_version_bytes"]
    # values.yaml's 64Gi over the job model's own retain_versions default + the one being written
    assert bound == 64 * GI // (WeightSyncConfig().retain_versions + 1)


@pytest.mark.parametrize(
    ("limit", "retain", "medium", "bound"),
    [
        ("24Gi", 2, "", 8 * GI),
        ("3Ti", 5, "", 3 * 1024**4 // 6),
        ("1500Mi", 2, "Memory", 500 * 1024**2),
        ("30Ki", 1, "", 15 * 1024),
        ("9G", 2, "", 3 * 10**9),
        ("4T", 3, "Memory", 10**12),
        ("3M", 2, "", 10**6),
        ("3000k", 2, "", 10**6),
        ("1000", 1, "", 500),
        (3 * GI, 2, "", GI),
    ],
)
def test_the_bound_is_the_quantity_in_bytes_over_retain_versions_plus_one(
    limit: str | int, retain: int, medium: str, bound: int
) -> None:
    values = {
        "weightSync": {"snapshotSizeLimit": limit, "snapshotMedium": medium},
        "job": {"weight_sync": {"retain_versions": retain}},
    }
    assert _weight_sync(values)["max_version_bytes"] == bound


@pytest.mark.parametrize("explicit", [0, 12345])
def test_the_jobs_own_max_version_bytes_is_kept(explicit: int) -> None:
    values = {"job": {"weight_sync": {"max_version_bytes": explicit}}}
    assert _weight_sync(values)["max_version_bytes"] == explicit


@pytest.mark.parametrize(
    "limit", ["1.5Gi", "64K", "500m", "1e9", "64GiB", "-1Gi", "0x10", "0123Mi"]
)
def test_a_size_limit_the_chart_cannot_read_fails_the_render_naming_it(limit: str) -> None:
    from helm_python import HelmRenderError

    with pytest.raises(
        HelmRenderError, match=r"weightSync\.snapshotSizeLimit .* is not a quantity"
    ):
        render_values({"weightSync": {"snapshotSizeLimit": limit}})


def test_a_size_limit_too_small_for_one_version_fails_the_render() -> None:
    from helm_python import HelmRenderError

    with pytest.raises(HelmRenderError, match="leaves no room for a version"):
        render_values({"weightSync": {"snapshotSizeLimit": "2"}})
