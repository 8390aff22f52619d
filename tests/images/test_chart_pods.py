"""`make image-test`: the chart's pods, run from the images built here, finish a small CPU job
with the demo's guarantees (no prompt lost, no group trained twice).

The images are built (or reused) by tests/images/build.py; the chart is rendered with the real
Helm engine (tests/helm/chart.py) for a small job on the demo's arithmetic task with the torch
engine and the CPU trainer image; every pod the chart renders for Redis, buffer, reward,
weight-sync, rollout and trainer is run by tests/images/pods.py with exactly the rendered
command, args, env, volumes, user and probes; the chart's `helm test` pod checks every service.
The accounting is kuberl's own (kuberl.local.accounting, as `kuberl run` and the chaos run use
it). Needs root, buildah, debootstrap and iproute2, so it runs only with KUBERL_IMAGE_TEST=1
(set by `make image-test`); `make test` skips it.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helm.chart import Rendered
from tests.support import REPO

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("KUBERL_IMAGE_TEST") != "1",
        reason="builds and runs container images as root: `make image-test` (KUBERL_IMAGE_TEST=1)",
    ),
    pytest.mark.timeout(2400),
]

NAMESPACE = "kuberl-test"
RELEASE = "rl"
# Steps enough that the trainer is still serving when the health pod runs: groups made while
# the trainer starts (max_inflight_groups: 4 steps of them) are trained within a second or two.
TOTAL_STEPS = 40
TRAINED_JSONL = "/checkpoints/trained.jsonl"
COMPONENTS = ["redis", "buffer", "reward", "weight-sync", "rollout", "trainer"]


def _image(ref: str) -> dict[str, str]:
    """Chart image values naming a local image reference `localhost/<repository>:<tag>`."""
    registry, rest = ref.split("/", 1)
    repository, tag = rest.rsplit(":", 1)
    return {"registry": registry, "repository": repository, "tag": tag}


def _values(refs: dict[str, str]) -> dict[str, Any]:
    """A small CPU job on the demo's task (examples/demo.yaml, scaled down to a few steps)."""
    claim = {"persistentVolumeClaim": {"claimName": "models"}}
    return {
        "images": {
            "kuberl": _image(refs["kuberl"]),
            "trainer": _image(refs["trainer"]),
            # The torch engine needs no SGLang: the rollout pod runs the CPU trainer image.
            "rollout": _image(refs["trainer"]),
            "redis": _image(refs["redis"]),
        },
        "model": {"path": "/models/policy", "volume": claim},
        "data": {"volume": {"persistentVolumeClaim": {"claimName": "datasets"}}},
        "rollout": {"replicas": 1, "sglang": {"enabled": False}},
        "trainer": {
            "nodes": 1,
            "gpusPerNode": 1,
            "gpu": False,
            "extraEnv": [{"name": "KUBERL_TRAINED_JSONL", "value": TRAINED_JSONL}],
        },
        "networkPolicy": {"enabled": False},
        "dashboards": {"enabled": False},
        "job": {
            "job": {"name": "image-test", "seed": 0},
            "model": {"dtype": "float32"},
            "data": {
                "train": [{"path": "/data/arith/train.jsonl", "name": "arith", "limit": 256}],
                "eval": [],
                "num_epochs": 1,
            },
            "buffer": {"lease_timeout_seconds": 60, "max_inflight_groups": 16},
            "reward": {"verifiers": {"gsm8k": 1.0}, "workers": 1, "timeout_seconds": 5},
            "rollout": {
                "engine": {"kind": "torch", "device": "cpu", "max_batch_size": 64},
                "sampling": {"temperature": 1.0, "max_new_tokens": 6},
                "group_size": 4,
                "prompts_per_batch": 4,
                "batches_in_flight": 1,
                "drain_seconds": 10,
            },
            "trainer": {
                "mode": "rl",
                "total_steps": TOTAL_STEPS,
                "groups_per_step": 4,
                "optimizer": {"lr": 1.0e-4},
                "max_staleness": 1,
                "publish_every": 1,
                "checkpoint_every": 2,
            },
        },
    }


def _claims(root: Path) -> dict[str, Path]:
    """The persistent volume claims the rendered pods name, as host folders: the demo's tiny
    Qwen2 with its character tokenizer (built here, as `make demo` does) under the model
    claim, the demo's arithmetic data under the data claim, an empty checkpoint claim."""
    from kuberl.common.modelbuild import build_model

    models = root / "models"
    build_model(models / "policy", arch="qwen2", size="tiny", tokenizer="digits", seed=0)
    datasets = root / "datasets"
    (datasets / "arith").mkdir(parents=True)
    shutil.copy(REPO / "examples" / "data" / "arith" / "train.jsonl", datasets / "arith")
    checkpoints = root / "checkpoints"
    checkpoints.mkdir()
    for folder in (models, datasets):
        for path in [folder, *folder.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    return {"models": models, "datasets": datasets, f"{RELEASE}-kuberl-checkpoints": checkpoints}


def _assert_a_cpu_cluster_could_schedule(rendered: Rendered) -> None:
    """This harness schedules nothing, so it checks what a CPU-only cluster's scheduler would
    refuse: any container of this CPU job that requests a GPU."""
    from tests.helm.chart import pod_spec, workloads

    gpu = [
        f"{doc['metadata']['name']}/{c['name']}"
        for doc in workloads(rendered)
        for c in pod_spec(doc)["containers"]
        if "nvidia.com/gpu" in (c.get("resources") or {}).get("limits", {})
    ]
    assert not gpu, f"this CPU job's pods request nvidia.com/gpu: {', '.join(gpu)}"


def test_the_charts_pods_run_a_job_to_completion_from_the_images(tmp_path: Path) -> None:
    from kuberl.local import accounting
    from tests.helm.chart import render_values
    from tests.images import build
    from tests.images.pods import Cluster

    refs = build.ensure_images()
    rendered = render_values(_values(refs), release=RELEASE)
    _assert_a_cpu_cluster_could_schedule(rendered)
    claims = _claims(tmp_path / "claims")
    # /var/tmp: the pods' volumes need a real filesystem (bind mounts, ownership), not a tmpfs.
    workdir = Path(os.environ.get("KUBERL_IMAGE_TEST_DIR", "/var/tmp/kuberl-image-test"))
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    cluster = Cluster(list(rendered.docs), NAMESPACE, claims, workdir / "pods", COMPONENTS)
    try:
        started = time.monotonic()
        for component in COMPONENTS:
            cluster.start(component)
        cluster.wait_ready(COMPONENTS, timeout=600)
        ready_seconds = time.monotonic() - started

        health = cluster.run_test_pod(f"{RELEASE}-kuberl-test-health", timeout=120)
        assert health.returncode == 0, health.stdout

        trainer = cluster.pods["trainer"]
        deadline = time.monotonic() + 900
        while trainer.proc is not None and trainer.proc.poll() is None:
            assert time.monotonic() < deadline, cluster.describe(COMPONENTS)
            for component in COMPONENTS:
                if component != "trainer":
                    cluster.check_failures(cluster.pods[component])
            time.sleep(2)
        assert trainer.proc is not None and trainer.proc.returncode == 0, cluster.tail(trainer)
        job_seconds = time.monotonic() - started

        # The services drain on SIGTERM (as on a pod deletion) before the accounting reads Redis.
        for component in ("rollout", "reward", "weight-sync", "buffer"):
            assert cluster.terminate(component) == 0, cluster.describe([component])
        lineage = accounting.trained_lineage(
            accounting.read_rows(claims[f"{RELEASE}-kuberl-checkpoints"] / "trained.jsonl")
        )
        redis = cluster.pods["redis"]
        password = cluster.secret_value(f"{RELEASE}-kuberl-redis", "redis-password")
        state = accounting.read_buffer_state(
            f"redis://{redis.address}:6379/0", "image-test", password
        )
        report = accounting.prompt_accounting(state, lineage)
    finally:
        cluster.close()

    print(
        f"image-test: pods ready in {ready_seconds:.0f} s, job done in {job_seconds:.0f} s; "
        f"accounting {report}"
    )
    assert (report["prompts_lost"], report["groups_trained_twice"]) == (0, 0), report
    assert report["lineage_steps"] == TOTAL_STEPS and report["prompts_trained_once"] > 0, report
