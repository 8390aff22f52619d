"""Publishing the policy's weights to weight-sync, and retrying a publish that failed.

Every rank gathers the parameters bucket by bucket (ZeRO-3 shards them); rank 0 streams them to
weight-sync. The trainer is never blocked by weight-sync: a failed publish is logged and retried
while rank 0 waits for batches (`retry_due`, broadcast as MSG_PUBLISH), since replicas left on
old weights would otherwise produce only groups too stale to train on. A refusal because
weight-sync already holds the version (or a newer one) is a real conflict and is not retried.
With `model.lora` a version is the adapter tensors only, every version (the first included),
named as in the injected HF model (`model.layers.0.self_attn.q_proj.lora_A.default.weight`): the
engines hold the same base model and apply them in place.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from kuberl.common import metrics as prom
from kuberl.common.config import JobConfig
from kuberl.common.logs import get_logger
from kuberl.common.lora import is_adapter_tensor
from kuberl.trainer.distributed import DistInfo
from kuberl.trainer.models import Models

log = get_logger(__name__)

PUBLISH_SECONDS = prom.histogram("kuberl_trainer_publish_seconds", "Weight publish wall time")
PUBLISH_FAILURES = prom.counter(
    "kuberl_trainer_publish_failures_total", "Weight publishes that failed", ["reason"]
)

PUBLISH_RETRY_SECONDS = 2.0
# Publishes refused as conflicts, though weight-sync does not hold the version, retried in a row.
PUBLISH_CONFLICT_RETRIES = 3


def publisher_options(device: torch.device) -> dict[str, Any]:
    """How rank 0 offers its weights to weight-sync (`WeightPublisher` keyword arguments).

    On a GPU, CUDA IPC comes first: an engine on the same host and GPU (`kuberl run --device
    cuda`) then copies each version device to device from the trainer's GPU buckets, while the
    host copy still goes to the service (shared memory, else a gRPC upload) for every other
    engine. On the CPU there is nothing to share by CUDA IPC: shared memory or the upload."""
    if device.type == "cuda":
        return {"transports": ("cuda_ipc", "shm", "snapshot"), "device": str(device)}
    return {"transports": ("shm", "snapshot"), "device": "cpu"}


class PolicyPublisher:
    """Publishes `models.policy` under a policy version (every rank; rank 0 uploads)."""

    def __init__(self, config: JobConfig, models: Models, dist: DistInfo) -> None:
        self.config = config
        self.models = models
        self.dist = dist
        tc = config.trainer
        self.enabled = tc.publish_weights and tc.mode != "eval"
        #: weight-sync's client (rank 0, once `connect`ed).
        self.client: Any = None
        #: The version last handed to `publish` (every rank; failures are retried apart).
        self.published_version = -1
        self._failed_at: float | None = None  # rank 0: the last publish failed then
        self._conflicts_retried = 0  # rank 0: refused publishes retried since the last success
        #: LoRA: only the adapter tensors travel.
        self.select = is_adapter_tensor if config.model.lora is not None else None
        #: rank 0: the figures of the last successful publish not yet taken (`take_metrics`).
        self._metrics: dict[str, float] = {}

    def connect(self) -> None:
        """Rank 0: the weight-sync client, when this job publishes."""
        if self.enabled:
            from kuberl.common.weights import WeightPublisher

            self.client = WeightPublisher(
                self.config.endpoints.weight_sync, **publisher_options(self.dist.device)
            )

    def retry_due(self) -> bool:
        """The last publish failed long enough ago to try again (rank 0)."""
        failed = self._failed_at
        return failed is not None and time.monotonic() - failed >= PUBLISH_RETRY_SECONDS

    def publish_current(self, version: int) -> None:
        """Publish `version` unless it was already (with `publish_every` > 1 the versions
        between are skipped, but an eval round and the job's end need the newest weights on
        the engines). Collective."""
        if self.published_version != version:
            self.publish(version)

    def publish(self, version: int) -> None:
        """Stream the gathered weights to weight-sync as `version`. Collective."""
        if not self.enabled:
            return
        self.published_version = version
        buckets = self.models.engine.full_parameters(
            self.config.weight_sync.bucket_bytes, "hf.", self.select
        )
        if not self.dist.is_main:
            for _ in buckets:
                pass
            return
        started = time.perf_counter()

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in buckets:
                yield from bucket

        try:
            result = self.client.publish(version, tensors())
            PUBLISH_SECONDS.observe(time.perf_counter() - started)
            self._metrics = {
                "publish/bytes": float(result.total_bytes),
                "publish/tensors": float(result.num_tensors),
                "publish/seconds": time.perf_counter() - started,
            }
            self._failed_at = None
            self._conflicts_retried = 0
        except Exception as exc:
            from kuberl.common.weights import VersionConflict

            conflict = isinstance(exc, VersionConflict)
            if conflict and self._conflicts_retried < PUBLISH_CONFLICT_RETRIES:
                # Refused, but weight-sync may not hold it: it restarted between Publish and
                # CommitPublish. A few retries; a refusal that lasts is a real conflict.
                conflict = self._held_elsewhere(version)
                self._conflicts_retried += 0 if conflict else 1
            PUBLISH_FAILURES.labels("version_conflict" if conflict else "error").inc()
            log.warning("weights.publish_failed", version=version, error=str(exc)[:300])
            self._failed_at = None if conflict else time.monotonic()
        finally:
            for _ in buckets:  # keep the other ranks' gathers matched
                pass

    def take_metrics(self) -> dict[str, float]:
        """The last publish's bytes, tensors and seconds, once (rank 0; empty elsewhere)."""
        out, self._metrics = self._metrics, {}
        return out

    def current_version(self) -> int:
        """The version weight-sync holds (0 when unreachable or not publishing)."""
        if self.client is None:
            return 0
        try:
            return int(self.client.current_version())
        except Exception as exc:
            log.warning("weight_sync.unreachable_at_resume", error=str(exc)[:300])
            return 0

    def _held_elsewhere(self, version: int) -> bool:
        """Weight-sync holds `version` or a newer one: a refused publish is a real conflict.
        Otherwise the refusal may come from a weight-sync restarted between Publish and
        CommitPublish, and the publish is retried (at most PUBLISH_CONFLICT_RETRIES times)."""
        try:
            return int(self.client.current_version()) >= version
        except Exception as exc:
            log.warning("weight_sync.unreachable", error=str(exc)[:300])
            return False
