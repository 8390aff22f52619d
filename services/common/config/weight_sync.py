"""The `weight_sync` section: the weight relay and its transports."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kuberl.common.config.base import Section, ServerConfig, server_field

TransportName = Literal["nccl", "gloo", "cuda_ipc", "snapshot", "shm"]


class WeightSyncConfig(Section):
    """The weight-sync service (`kuberl.weight_sync`) and its clients (`kuberl.common.weights`).

    The trainer hands each version to the service (shared memory on the same host, else a
    checked gRPC upload) and returns; the service relays it to every engine over the first
    transport in `transports` that the engine also offers (see docs/weight-sync.md)."""

    server: ServerConfig = server_field(50053, 9103)
    transports: list[TransportName] = Field(
        default_factory=lambda: list[TransportName](
            ["cuda_ipc", "nccl", "shm", "gloo", "snapshot"]
        ),
        description="Transports the relay offers engines, in order of preference; each is used "
        "only where it can work: cuda_ipc for an engine on the trainer's host and GPU (when the "
        "trainer exported CUDA IPC handles), nccl when `device` is a GPU and the engine has "
        "another one, shm for engines on the service's host; snapshot is always available for "
        "catch-up.",
    )
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description='Device of the relay\'s NCCL broadcasts ("cuda", "cuda:0"): each bucket is '
        "staged there from the service's memory. cpu: the relay sends no NCCL (engines get the "
        "next transport they offer; SGLang engines, which take only nccl, snapshot or, on the "
        "trainer's GPU, cuda_ipc, then load every version from a snapshot or by cuda_ipc). On "
        "Kubernetes the chart sets cuda, and gives the weight-sync pod a GPU, when rollout runs "
        "SGLang and nccl is in `transports`.",
    )
    bucket_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024 * 1024,
        description="Broadcast bucket size: tensors are packed back to back into buckets of at "
        "most this many bytes (a larger tensor travels alone), one broadcast per bucket.",
    )
    heartbeat_seconds: float = Field(
        2.0,
        gt=0,
        description="Heartbeat period the service tells each engine when it registers (a "
        "heartbeat is a long poll answered at once when an update is pending); an engine silent "
        "for heartbeat_seconds x missed_heartbeats is dropped from the pool.",
    )
    missed_heartbeats: int = Field(3, ge=1, description="Drop an engine after this many.")
    snapshot_bytes_per_second: float = Field(
        0.0,
        ge=0,
        description="Most snapshot bytes per second one pod streams, all its streams together "
        "(the service, and each engine passing versions on): keeps weight-sync from filling a "
        "NIC the buffer and trainer share. 0: no limit.",
    )
    relay_fanout: int = Field(
        0,
        ge=0,
        description="Snapshot relay tree: engines that hold a version stream it on to at most "
        "this many others at a time (and the service to this many), so a version reaches N "
        "engines in ~log(N) transfer times and the service streams this many at once, not N. "
        "torch and simulated engines serve peers; SGLang engines only download. 0: the "
        "service streams every snapshot itself.",
    )
    broadcast_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="An engine that has not received and loaded a version within this is timed "
        "out of that version (it catches up later by snapshot); nobody else waits for it.",
    )
    snapshot_chunk_bytes: int = Field(
        4 * 1024 * 1024,
        ge=64 * 1024,
        description="Chunk size of snapshot downloads when the engine asks for none (capped by "
        "the server's max_message_bytes less 64 KiB); each chunk is checked before it is used.",
    )
    snapshot_dir: str = Field(
        ".kuberl/snapshots",
        description="Where versions are kept when shm_dir is unusable (no /dev/shm).",
    )
    shm_dir: str = Field(
        "/dev/shm/kuberl-weight-sync",
        description="Shared-memory folder holding the retained versions (and where a trainer on "
        "the same host writes a version directly).",
    )
    retain_versions: int = Field(
        2, ge=1, description="Complete versions kept (older ones are deleted once superseded)."
    )
    max_version_bytes: int = Field(
        0,
        ge=0,
        description="Most bytes one version may have in the store: an upload is refused at the "
        "chunk that would cross it, before its manifest arrives. 0: the size of the store "
        "folder's filesystem / (retain_versions + 1), room for the versions kept and the one "
        "being written; a positive value caps that (the smaller of the two applies), for a "
        "folder allowed less than its filesystem holds. The chart sets it to "
        "weightSync.snapshotSizeLimit / (retain_versions + 1) unless the job sets it.",
    )
    advertise_host: str | None = Field(
        None,
        description="Address engines use to reach this service's broadcast groups (the pod IP "
        "on Kubernetes); null uses the host's name resolved, 127.0.0.1 as a last resort.",
    )
    notify_engines: bool = Field(
        True,
        description="Also push each update to the replica's RolloutService.NotifyWeightsUpdate "
        "(best effort; engines always learn of updates through their heartbeat).",
    )
