"""A model named by Hugging Face id (`model.path: Qwen/Qwen2.5-7B-Instruct`): one Job downloads it
into the models volume with the token from a Secret, every pod that mounts the volume waits for
the download and reads the same folder, and only the Job may leave the cluster, only when asked.
The Job's script runs here against the hub stand-in (tests/hub_standin.py: the real hub cannot be
reached)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.chart import VALUE_SETS, pod_spec, render, render_values, workloads
from tests.helm.upgrade import refused_changes
from tests.hub_standin import hub_standin

helm = pytest.importorskip("helm_python", reason="helm-python-sdk not installed")

HUB_ID = "Qwen/Qwen2.5-7B-Instruct"
FOLDER = f"/models/{HUB_ID}"


def _job(rendered) -> dict[str, Any]:
    (job,) = rendered.all("Job")
    return job


def _download(rendered) -> dict[str, Any]:
    return pod_spec(_job(rendered))["containers"][0]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_a_model_path_on_a_volume_downloads_nothing() -> None:
    rendered = render("multi-node-trainer")
    init = [c["name"] for d in workloads(rendered) for c in pod_spec(d).get("initContainers", [])]
    policies = {d["metadata"]["name"] for d in rendered.all("NetworkPolicy")}
    assert (rendered.all("Job"), init, "rl-kuberl-model-download" in policies) == ([], [], False)


def test_the_download_job_writes_the_id_into_the_volume_with_the_secrets_token() -> None:
    container = _download(render("hub-model"))
    env = _env(container)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "model")
    assert (env["KUBERL_MODEL_ID"], env["KUBERL_MODEL_DIR"], env["KUBERL_MODEL_REVISION"]) == (
        HUB_ID,
        FOLDER,
        "main",
    )
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert (mount["mountPath"], mount.get("readOnly", False)) == ("/models", False)


def test_every_model_reading_pod_waits_for_the_download_and_reads_the_same_folder() -> None:
    rendered = render("hub-model")
    job_volume = next(v for v in pod_spec(_job(rendered))["volumes"] if v["name"] == "model")
    served = yaml.safe_load(rendered.get("ConfigMap", "job")["data"]["job.yaml"])["model"]["path"]
    rollout = pod_spec(rendered.get("Deployment", "rollout"))
    sglang = next(c for c in rollout["containers"] if c["name"] == "sglang")
    readers = {}
    for doc in workloads(rendered):
        spec = pod_spec(doc)
        volume = next((v for v in spec.get("volumes", []) if v["name"] == "model"), None)
        if volume is None or doc["kind"] == "Job":
            continue
        (wait,) = [c for c in spec["initContainers"] if c["name"] == "wait-for-model"]
        readers[doc["metadata"]["name"]] = (
            volume["persistentVolumeClaim"]["claimName"],
            f"{FOLDER}/.kuberl-download-complete" in wait["command"][2],
        )
    assert (served, sglang["args"][sglang["args"].index("--model-path") + 1]) == (FOLDER, FOLDER)
    claim = job_volume["persistentVolumeClaim"]["claimName"]
    assert readers == {
        name: (claim, True)
        for name in ("rl-kuberl-reward", "rl-kuberl-rollout", "rl-kuberl-trainer")
    }


@pytest.mark.parametrize("allow", [False, True])
def test_only_the_download_may_leave_the_cluster_and_only_when_allowed(allow: bool) -> None:
    rendered = render("hub-model", model={"download": {"allowEgress": allow}})
    policies = {d["metadata"]["name"]: d["spec"] for d in rendered.all("NetworkPolicy")}
    outbound = {
        name: any(
            not rule.get("to") and {p["port"] for p in rule.get("ports", [])} & {443}
            for rule in spec.get("egress", [])
        )
        for name, spec in policies.items()
    }
    expected = {"rl-kuberl-model-download"} if allow else set()
    assert {n for n, out in outbound.items() if out} == expected
    assert policies["rl-kuberl-model-download"]["ingress"] == []


def test_a_hub_id_without_a_models_volume_fails_naming_the_value() -> None:
    with pytest.raises(helm.HelmRenderError) as err:
        render_values({"model": {"path": HUB_ID}})
    assert f'model.path "{HUB_ID}" is a Hugging Face id' in str(err.value)
    assert "Set model.volume" in str(err.value)


def test_a_new_revision_is_a_new_job_not_an_update_kubernetes_refuses() -> None:
    before, same = render("hub-model"), render_values(VALUE_SETS["hub-model"])
    after = render("hub-model", model={"download": {"revision": "v2"}})
    names = [_job(r)["metadata"]["name"] for r in (before, same, after)]
    assert names[0] == names[1] != names[2]
    assert refused_changes(before, after) == []


def _run_download(container: dict[str, Any], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *container["command"][1:]],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_jobs_script_downloads_once_with_the_token_and_marks_the_folder(tmp_path: Path) -> None:
    container = _download(render("hub-model"))
    env = {k: v for k, v in _env(container).items() if isinstance(v, str)}
    files = {"config.json": b'{"model_type": "qwen2"}', "model.safetensors": b"\0" * 4096}
    repo = tmp_path / "repo"
    repo.mkdir()
    for name, body in files.items():
        (repo / name).write_bytes(body)
    with hub_standin() as hub:
        hub.add("model", HUB_ID, repo)
        env |= {
            "KUBERL_MODEL_DIR": str(tmp_path / "models" / HUB_ID),
            "HF_HOME": str(tmp_path / "models" / ".cache" / "huggingface"),
            "HF_ENDPOINT": hub.url,
            "HF_TOKEN": "hf_secret_from_the_secret",
        }
        first = _run_download(container, env)
        fetched = sorted(p.rsplit("/", 1)[1] for p in hub.downloads())
        second = _run_download(container, env)
    folder = tmp_path / "models" / HUB_ID
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert fetched == sorted(files) and len(hub.downloads()) == len(files)
    assert {auth for _, _, auth in hub.requests} == {"Bearer hf_secret_from_the_secret"}
    assert (folder / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert (folder / ".kuberl-download-complete").read_text() == f"{HUB_ID}@main\n"
    assert "already in" in second.stdout


def test_a_failed_download_leaves_no_mark(tmp_path: Path) -> None:
    container = _download(render("hub-model"))
    env = {k: v for k, v in _env(container).items() if isinstance(v, str)}
    with hub_standin() as hub:
        env |= {
            "KUBERL_MODEL_DIR": str(tmp_path / HUB_ID),
            "HF_HOME": str(tmp_path / "hf"),
            "HF_ENDPOINT": hub.url,
        }
        failed = _run_download(container, env)
    assert failed.returncode != 0 and not (tmp_path / HUB_ID / ".kuberl-download-complete").exists()


def test_the_wait_step_waits_until_the_mark_names_this_revision(tmp_path: Path) -> None:
    rendered = render("hub-model")
    (wait,) = pod_spec(rendered.get("StatefulSet", "trainer"))["initContainers"]
    folder = tmp_path / HUB_ID
    folder.mkdir(parents=True)
    script = wait["command"][2].replace(FOLDER, str(folder))
    marker = folder / ".kuberl-download-complete"
    marker.write_text(f"{HUB_ID}@an-older-revision\n")
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(["/bin/sh", "-c", script], capture_output=True, timeout=2)
    marker.write_text(f"{HUB_ID}@main\n")
    done = subprocess.run(["/bin/sh", "-c", script], capture_output=True, timeout=10)
    assert done.returncode == 0
