"""Model, data and checkpoint volumes: what pods only read is attached read-only (so the kubelet
never walks a large model volume to change its group), and a checkpoint volume the kubelet does
not chown for fsGroup (NFS) can be given to the trainer's user by an init step."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helm.chart import kubernetes_validate, pod_spec, render, workloads

NFS = {"nfs": {"server": "nfs.storage.svc", "path": "/exports/models"}}


def _volumes(rendered, name: str) -> dict[str, tuple[dict[str, Any], bool]]:
    """{workload: (volume source, mounted read-only everywhere)} of the volume `name`."""
    found = {}
    for doc in workloads(rendered):
        spec = pod_spec(doc)
        volume = next((v for v in spec.get("volumes", []) if v["name"] == name), None)
        if volume is None:
            continue
        mounts = [
            m
            for c in spec["containers"] + spec.get("initContainers", [])
            for m in c.get("volumeMounts", [])
            if m["name"] == name
        ]
        found[doc["metadata"]["name"]] = (volume, all(m.get("readOnly") for m in mounts))
    return found


@pytest.mark.parametrize("name", ["model", "data"])
def test_model_and_data_claims_are_attached_read_only_where_pods_only_read_them(name) -> None:
    volumes = _volumes(render("multi-node-trainer"), name)
    assert volumes and all(
        v["persistentVolumeClaim"]["readOnly"] is True and mounted
        for v, mounted in volumes.values()
    ), volumes


def test_an_nfs_model_volume_is_mounted_read_only_and_a_hostpath_one_unchanged() -> None:
    nfs = _volumes(render("multi-node-trainer", model={"volume": NFS}), "model")
    host = {"hostPath": {"path": "/mnt/models", "type": "Directory"}}
    hostpath = _volumes(render("multi-node-trainer", model={"volume": host}), "model")
    assert {v["nfs"]["readOnly"] for v, _ in nfs.values()} == {True}
    # hostPath has no readOnly field (strict validation would refuse one): the mounts say it.
    assert {(str(v["hostPath"]), mounted) for v, mounted in hostpath.values()} == {
        (str(host["hostPath"]), True)
    }


def test_trainer_pods_change_a_volumes_group_only_when_its_root_differs() -> None:
    context = pod_spec(render("multi-node-trainer").get("StatefulSet", "trainer-worker"))[
        "securityContext"
    ]
    assert (context["fsGroup"], context["fsGroupChangePolicy"]) == (10001, "OnRootMismatch")


def _owner_step() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rendered = render("multi-node-trainer", trainer={"checkpoints": {"fixOwnership": True}})
    return rendered.get("StatefulSet", "trainer-worker"), list(rendered.docs)


def test_fix_ownership_adds_one_root_step_with_only_chown_rights() -> None:
    worker, _ = _owner_step()
    (step,) = pod_spec(worker)["initContainers"]
    context = step["securityContext"]
    assert (step["name"], step["volumeMounts"]) == (
        "checkpoint-owner",
        [{"name": "checkpoints", "mountPath": "/checkpoints"}],
    )
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert (context["allowPrivilegeEscalation"], context["readOnlyRootFilesystem"]) == (False, True)
    assert "initContainers" not in pod_spec(
        render("multi-node-trainer").get("StatefulSet", "trainer")
    )


def test_the_ownership_step_leaves_a_folder_it_owns_writable_by_the_group(tmp_path: Path) -> None:
    """Its script, run here on a folder this user owns, with the chart's uid:gid replaced by
    ours (chown to another user needs root, which this test does not have)."""
    worker, _ = _owner_step()
    (step,) = pod_spec(worker)["initContainers"]
    folder = tmp_path / "checkpoints"
    folder.mkdir(mode=0o700)
    script = step["command"][2].replace("/checkpoints", str(folder))
    script = script.replace("10001:10001", f"{os.getuid()}:{os.getgid()}")
    done = subprocess.run(["/bin/sh", "-ec", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert oct(folder.stat().st_mode & 0o7770) == oct(0o2770)


def test_the_read_only_and_ownership_renders_validate_strictly() -> None:
    kv = kubernetes_validate()
    _, docs = _owner_step()
    docs += list(render("multi-node-trainer", model={"volume": NFS}).docs)
    problems = []
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "Deployment"):
            try:
                kv.validate(doc, kv.latest_version(), strict=True)
            except kv.ValidationError as exc:
                problems.append(f"{doc['metadata']['name']}: {exc.message}")
    assert problems == []
