"""The `buffer` section: the prompt and trajectory streams between rollout and trainer."""

from __future__ import annotations

from pydantic import Field

from kuberl.common.config.base import Section, ServerConfig, server_field


class BufferConfig(Section):
    server: ServerConfig = server_field(50051, 9101)
    lease_timeout_seconds: float = Field(
        120.0, gt=0, description="A leased prompt not completed within this is re-delivered."
    )
    max_inflight_groups: int = Field(
        64,
        ge=1,
        description="Backpressure: leasing is refused while this many groups are leased or "
        "generated but not yet trained.",
    )
    batch_ack_timeout_seconds: float = Field(
        300.0, gt=0, description="An un-acked batch is re-delivered after this (trainer crash)."
    )
    requeue_stale: bool = Field(
        True, description="Re-queue the prompts of groups dropped as stale (else count and drop)."
    )
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards all agree."
    )
    filters: list[str] = Field(
        default_factory=list,
        description="Custom group filters as module:function, called (group) -> bool (keep), "
        "with a kuberl.common.trajectory.Group; applied to training groups only.",
    )
    backpressure_retry_seconds: float = Field(
        1.0, gt=0, description="retry-after hint sent with RESOURCE_EXHAUSTED on LeasePrompts."
    )
    payload_cache_mib: int = Field(
        256,
        ge=0,
        description="Memory (MiB) for the bytes of groups this replica accepted, kept until a "
        "batch of this replica takes them so it need not read them back from Redis (oldest "
        "evicted first; a miss reads Redis; 0 = off). Counts against the pod's memory limit.",
    )
    acked_batch_ttl_seconds: float = Field(
        7 * 24 * 3600.0,
        gt=0,
        description="How long the record of an acknowledged batch is kept so that a repeated "
        "Ack answers already_acked (afterwards it is NOT_FOUND).",
    )
    queue_slice_prompts: int = Field(
        1024,
        ge=1,
        description="Prompts of an epoch queued per Redis script, slice by slice as leases "
        "reach the end of what is queued: Redis answers nothing else while a script runs, so "
        "queueing a large dataset whole stalled every replica at each epoch start.",
    )
    max_sequence_tokens: int = Field(
        0,
        ge=0,
        description="Most prompt + response tokens of one sample a put may carry (0 = the "
        "model's max_position_embeddings, read from model.path/config.json when the buffer "
        "can read it, else no bound: set it where the buffer does not mount the model).",
    )
