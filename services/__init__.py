"""kuberl: reinforcement-learning post-training for LLMs as Kubernetes-native microservices.

Each subpackage is one deployable service (`kuberl.buffer`, `kuberl.rollout`, `kuberl.reward`,
`kuberl.trainer`, `kuberl.weight_sync`) or the local supervisor (`kuberl.local`), plus
`kuberl.common`, the runtime they share, and `kuberl.api`, the generated gRPC contracts.
Services meet only in `kuberl.api` and `kuberl.common` (tests/unit/test_boundaries.py holds the
rule and enforces it). `kuberl.run(job)` is the Python API of `kuberl run`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__version__ = "0.1.0"


def run(job: Any, *, overrides: Sequence[str] = (), **options: Any) -> dict[str, Any]:
    """Run a whole job on this machine, as `kuberl run` does, and return its summary.

    `job` is a job file's path, a dict of sections or a `kuberl.common.config.JobConfig`;
    `overrides` are `section.field=value` strings (`["trainer.total_steps=20"]`); `options` are
    those of `kuberl.local.api.run` (run_dir, rollout_replicas, device, resume, ...).
    """
    from kuberl.local.api import run as run_job

    return run_job(job, overrides=overrides, **options)
