"""The GitHub workflows: actionlint finds nothing in .github/workflows (and does find a broken
workflow, so a pass means something), and the release workflow pushes the three images the
chart pulls, tagged with the chart's appVersion, with an SBOM and max-mode provenance, from
actions pinned to commit SHAs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.chart import pod_spec, render, workloads
from tests.support import REPO

WORKFLOWS = REPO / ".github" / "workflows"
RELEASE = WORKFLOWS / "release.yml"


def _actionlint(*paths: Path) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("actionlint") or str(REPO / ".venv" / "bin" / "actionlint")
    if not Path(binary).exists():
        pytest.fail("actionlint is not installed: `make setup` installs the dev extra")
    return subprocess.run(
        [binary, "-no-color", *map(str, paths)], capture_output=True, text=True, cwd=REPO
    )


def _release() -> dict[str, Any]:
    workflow: dict[str, Any] = yaml.safe_load(RELEASE.read_text())
    return workflow


def _build_step() -> dict[str, Any]:
    steps = _release()["jobs"]["image"]["steps"]
    return next(s for s in steps if s.get("uses", "").startswith("docker/build-push-action@"))


def test_actionlint_finds_nothing_in_the_workflows() -> None:
    workflows = sorted(WORKFLOWS.glob("*.y*ml"))
    result = _actionlint(*workflows)
    assert workflows and (result.returncode, result.stdout + result.stderr) == (0, "")


def test_actionlint_fails_a_broken_workflow(tmp_path: Path) -> None:
    broken = tmp_path / ".github" / "workflows" / "broken.yml"
    broken.parent.mkdir(parents=True)
    release = _release()
    # A job that needs one that does not exist, and an output read from an unknown step.
    release["jobs"]["image"]["needs"] = "versions"
    broken.write_text(yaml.safe_dump(release, sort_keys=False))
    result = _actionlint(broken)
    assert result.returncode != 0 and "versions" in result.stdout


def test_every_action_is_pinned_to_a_commit_sha() -> None:
    uses = re.findall(r"uses:\s*(\S+)", RELEASE.read_text())
    assert uses and all(re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", u) for u in uses), uses


def test_the_release_pushes_the_three_images_the_chart_pulls() -> None:
    matrix = _release()["jobs"]["image"]["strategy"]["matrix"]["include"]
    built = {m["image"]: m["dockerfile"] for m in matrix}
    assert built == {
        "kuberl": "Dockerfiles/kuberl.Dockerfile",
        "kuberl-trainer": "Dockerfiles/trainer.Dockerfile",
        "kuberl-rollout": "Dockerfiles/rollout.Dockerfile",
    }
    assert all((REPO / dockerfile).is_file() for dockerfile in built.values())
    app_version = yaml.safe_load((REPO / "helm" / "kuberl" / "Chart.yaml").read_text())[
        "appVersion"
    ]
    pulled = set()
    for doc in workloads(render("defaults")):
        spec = pod_spec(doc)
        for container in spec["containers"] + spec.get("initContainers", []):
            pulled.add(container["image"])
    # The chart's default registry is the GitHub organisation kuberl's: what this workflow
    # pushes when it runs in that organisation's repository.
    assert {f"ghcr.io/kuberl/{name}:{app_version}" for name in built} <= pulled, pulled


def test_images_are_tagged_with_the_charts_app_version_on_ghcr() -> None:
    tags = _build_step()["with"]["tags"]
    assert tags == (
        "ghcr.io/${{ needs.version.outputs.owner }}/${{ matrix.image }}:"
        "${{ needs.version.outputs.app_version }}"
    )
    script = next(s for s in _release()["jobs"]["version"]["steps"] if s.get("id") == "chart")
    assert "helm/kuberl/Chart.yaml" in script["run"] and "appVersion" in script["run"]
    assert "GITHUB_REPOSITORY_OWNER,," in script["run"]


def test_the_version_script_reads_the_charts_app_version(tmp_path: Path) -> None:
    script = next(s for s in _release()["jobs"]["version"]["steps"] if s.get("id") == "chart")
    chart = tmp_path / "helm" / "kuberl" / "Chart.yaml"
    chart.parent.mkdir(parents=True)
    shutil.copy(REPO / "helm" / "kuberl" / "Chart.yaml", chart)
    output = tmp_path / "out"
    env = {
        "PATH": "/usr/bin:/bin",
        "GITHUB_OUTPUT": str(output),
        "GITHUB_REPOSITORY_OWNER": "KubeRL",
        "REF_TYPE": "tag",
        "REF_NAME": "v" + str(yaml.safe_load(chart.read_text())["appVersion"]),
    }
    done = subprocess.run(["bash", "-ec", script["run"]], cwd=tmp_path, env=env)
    assert done.returncode == 0
    assert output.read_text().split() == [
        f"app_version={env['REF_NAME'][1:]}",
        "owner=kuberl",
    ]
    env["REF_NAME"] = "v9.9.9"
    assert subprocess.run(["bash", "-ec", script["run"]], cwd=tmp_path, env=env).returncode == 1


def test_images_carry_an_sbom_and_max_provenance() -> None:
    options = _build_step()["with"]
    assert (options["sbom"], options["provenance"], options["push"]) == (True, "mode=max", True)
