"""Trainer side of weight sync: hand each new policy version to the weight-sync service.

The trainer calls `WeightPublisher.publish(version, named_tensors)` with an iterator of
ZeRO-3-gathered parameters and the publisher never holds more than one tensor of it: on the
service's host each tensor is written straight into the shared-memory file the service names
(`shm`), elsewhere it goes as CRC32C-checked chunks of a gRPC upload (`snapshot`). The call returns
once the bytes have left the trainer; the service relays them, so a slow or dead engine never blocks
training. Versions must increase (`VersionConflict` otherwise).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
from kuberl.common.channels import DEFAULT_MAX_MESSAGE_BYTES, sync_channel
from kuberl.common.logs import get_logger
from kuberl.common.weights.chunks import DEFAULT_CHUNK_BYTES, iter_chunks
from kuberl.common.weights.manifest import ManifestBuilder, TensorEntry
from kuberl.common.weights.transports import transport_name, transport_value
from kuberl.common.weights.transports.cuda_ipc import export_cuda_ipc, gpu_uuid
from kuberl.common.weights.transports.shm import ShmWriter

log = get_logger(__name__)

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


class VersionConflict(RuntimeError):
    """The service refused the version (not above the latest one): FAILED_PRECONDITION."""


@dataclass
class PublishResult:
    version: int
    #: How the bytes left the trainer: "shm" or "snapshot" (the gRPC upload).
    transport: str
    total_bytes: int
    num_tensors: int
    seconds: float
    #: Engines the service started relaying the version to.
    engine_ids: list[str] = field(default_factory=list)
    #: Sets of CUDA IPC handles exported for engines on this GPU (0: none).
    cuda_ipc_sets: int = 0


class GpuBuckets:
    """A version packed into flat uint8 GPU buckets as tensors stream by (for CUDA IPC)."""

    def __init__(self, device: str, bucket_bytes: int) -> None:
        self.device, self.bucket_bytes = device, bucket_bytes
        self._buckets: list[torch.Tensor] = []

    def add(self, entry: TensorEntry, tensor: torch.Tensor) -> None:
        while len(self._buckets) <= entry.bucket:
            # A tensor larger than a bucket travels alone in a bucket of its own size.
            capacity = max(self.bucket_bytes, entry.nbytes)
            self._buckets.append(torch.empty(capacity, dtype=torch.uint8, device=self.device))
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        self._buckets[entry.bucket][entry.offset : entry.offset + entry.nbytes].copy_(raw)

    def finish(self, bucket_sizes: list[int]) -> list[torch.Tensor]:
        return [b[:n] for b, n in zip(self._buckets, bucket_sizes, strict=True)]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's raw little-endian bytes on the host (copied from the GPU if needed)."""
    data = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    return data.numpy().data


class WeightPublisher:
    """Publishes versions to the weight-sync service at `address` (host:port).

    With `cuda_ipc` offered and a GPU `device`, when the service counts engines on this host and
    GPU, each version is also packed into flat GPU buckets (one more copy of the weights in GPU
    memory, kept until the next publish) whose CUDA IPC handles (JSON, one set per such engine)
    ride on the commit, so those engines copy device to device.
    """

    def __init__(
        self,
        address: str,
        *,
        transports: Sequence[str] = ("shm", "snapshot"),
        host: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = 600.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        device: str = "cpu",
    ) -> None:
        """`transports`: how the trainer may hand versions over ("shm", "snapshot"), plus
        "cuda_ipc" to also export GPU buckets to engines on `device`'s GPU."""
        self.address = address
        self.device = device
        self.gpu_uuid = gpu_uuid(device) if "cuda_ipc" in transports else ""
        self.transports: list[Any] = [
            transport_value(t) for t in transports if t != "cuda_ipc" or self.gpu_uuid
        ]
        self.host = host or socket.gethostname()
        #: The GPU buckets of the last version exported by CUDA IPC (engines may still copy).
        self._exported: list[torch.Tensor] = []
        #: Whether the publish in progress has sent CUDA IPC handles.
        self._sent_cuda_ipc = False
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self._channel = sync_channel(address, max(max_message_bytes, 2 * chunk_bytes))
        self._stub = pb_grpc.WeightSyncServiceStub(self._channel)

    def current_version(self) -> int:
        """The latest complete version the service holds (0 before the first)."""
        return int(self._stub.GetVersion(pb.GetVersionRequest(), timeout=30).version)

    def publish(
        self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> PublishResult:
        """Send every (name, tensor) as `version`; returns once the service has the bytes.

        VersionConflict (the service's FAILED_PRECONDITION) when `version` is not above the
        latest one, or when a later version was published (by another trainer rank or a
        restarted trainer) while this one was sent."""
        self._sent_cuda_ipc = False
        try:
            return self._publish(version, named_tensors)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                raise VersionConflict(exc.details()) from None
            if exc.code() is grpc.StatusCode.INVALID_ARGUMENT and self._sent_cuda_ipc:
                self._stop_cuda_ipc(version, exc.details() or "")
            raise

    def _stop_cuda_ipc(self, version: int, reason: str) -> None:
        """The service refused this version's CUDA IPC handles (a torch whose handle format it
        does not know, say): publish without them from now on, so the trainer's retry of this
        version goes by shared memory or snapshot instead of being refused forever."""
        self.transports = [t for t in self.transports if t != pb.TRANSPORT_CUDA_IPC]
        self.gpu_uuid = ""
        self._exported = []
        log.error(
            "weights.cuda_ipc_refused",
            version=version,
            error=reason[:300],
            now=[transport_name(t) for t in self.transports],
        )

    def _publish(
        self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> PublishResult:
        started = time.perf_counter()
        answer = self._stub.Publish(
            pb.PublishRequest(
                version=version,
                transports=self.transports,
                trainer_host=self.host,
                gpu_uuid=self.gpu_uuid,
            ),
            timeout=30,
        )
        bucket_bytes = answer.send.manifest.bucket_bytes or DEFAULT_BUCKET_BYTES
        builder = ManifestBuilder(bucket_bytes)
        sets = answer.cuda_ipc_engines if self.gpu_uuid else 0
        gpu = GpuBuckets(self.device, bucket_bytes) if sets else None
        count = 0

        def place(name: str, tensor: torch.Tensor) -> TensorEntry:
            nonlocal count
            entry = builder.add(name, tensor.dtype, tensor.shape)
            if gpu is not None:
                gpu.add(entry, tensor)
            count += 1
            return entry

        def handles() -> str:
            if gpu is None:
                return ""
            buckets = gpu.finish(builder.build().bucket_sizes)
            exported = export_cuda_ipc(buckets, sets)
            self._exported = buckets  # the previous version's are left to torch's IPC limbo
            self._sent_cuda_ipc = True
            return exported

        if answer.send.transport == pb.TRANSPORT_SHM:
            path = json.loads(answer.send.handles_json)["path"]
            writer = ShmWriter(path)
            try:
                for name, tensor in named_tensors:
                    writer.write(place(name, tensor).flat_offset, tensor)
                manifest = builder.build()
                writer.close(manifest.total_bytes)
                done = self._stub.CommitPublish(
                    pb.CommitPublishRequest(
                        version=version,
                        manifest=manifest.to_proto(),
                        cuda_ipc_handles_json=handles(),
                    ),
                    timeout=self.timeout_s,
                )
            except BaseException:
                writer.abort()
                raise
            engine_ids = list(done.engine_ids)
        else:

            def pieces() -> Iterator[memoryview]:
                for name, tensor in named_tensors:
                    place(name, tensor)
                    yield tensor_bytes(tensor)

            chunks = iter_chunks(
                version,
                pieces(),
                chunk_bytes=self.chunk_bytes,
                manifest_last=builder.build,
                cuda_ipc_last=handles if gpu is not None else None,
            )
            uploaded = self._stub.UploadSnapshot(chunks, timeout=self.timeout_s)
            manifest = builder.build()
            engine_ids = list(uploaded.engine_ids)
        result = PublishResult(
            version=version,
            transport=transport_name(answer.send.transport),
            total_bytes=manifest.total_bytes,
            num_tensors=count,
            seconds=time.perf_counter() - started,
            engine_ids=engine_ids,
            cuda_ipc_sets=sets,
        )
        log.info(
            "weights.published",
            version=version,
            transport=result.transport,
            bytes=result.total_bytes,
            tensors=count,
            seconds=round(result.seconds, 4),
            engines=len(engine_ids),
            cuda_ipc_sets=sets,
        )
        return result

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
