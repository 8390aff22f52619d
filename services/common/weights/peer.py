"""An engine's side of the weight-sync relay: it streams the version it holds to other engines.

`PeerServer` answers `WeightSyncService.StreamSnapshot` (nothing else) from the version its
`EngineClient` last loaded, in the same checked chunks as the service, so a downloader cannot
tell a peer from the service. The relay (`kuberl.weight_sync.relay`) sends a peer at most
`relay_fanout` downloaders at a time. The bytes are the client's double buffer, which is
rewritten only when the version after next arrives; a stream whose version the engine no longer
holds stops with UNAVAILABLE (the downloader reports the failure and is sent elsewhere), so a
stream never mixes two versions. Under roles (kuberl.common.roles) only engines (the rollout
role) may download, as from the service.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
from kuberl.common import tls as transport
from kuberl.common.channels import DEFAULT_MAX_MESSAGE_BYTES
from kuberl.common.errors import PermissionDenied
from kuberl.common.roles import RoleCheck, identity_source
from kuberl.common.server import server_grpc_options
from kuberl.common.weights.chunks import DEFAULT_CHUNK_BYTES, Pacer, iter_chunks
from kuberl.common.weights.manifest import Manifest

#: Streams a peer serves at once: the relay sends at most `relay_fanout`; a few more are refused.
MAX_STREAMS = 8
STREAM_SNAPSHOT = f"/{pb.DESCRIPTOR.services_by_name['WeightSyncService'].full_name}/StreamSnapshot"


@dataclass(frozen=True)
class Held:
    version: int
    manifest: Manifest
    flat: torch.Tensor  # uint8 [total_bytes], on the CPU


class PeerServer(pb_grpc.WeightSyncServiceServicer):
    """Serves the held version's snapshot on `host`:`port` (0: a free one; `endpoint`)."""

    def __init__(
        self,
        host: str,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        bytes_per_second: float = 0.0,
        job: str = "",
        port: int = 0,
    ) -> None:
        """`bytes_per_second`: cap on what this engine streams (`snapshot_bytes_per_second`);
        `job`: whose engines may download, under roles."""
        self.host = host
        self.pacer = Pacer(bytes_per_second)
        self._held: Held | None = None
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=MAX_STREAMS, thread_name_prefix="peer"),
            options=server_grpc_options(max_message_bytes),
            maximum_concurrent_rpcs=MAX_STREAMS,
        )
        pb_grpc.add_WeightSyncServiceServicer_to_server(self, self._server)
        settings = transport.current()  # the job's TLS: downloaders' channels use it too
        source = identity_source(settings)
        self.roles = RoleCheck("rollout", job, source) if source is not None else None
        if settings.enabled:
            credentials = transport.server_credentials(settings)
            self.port = self._server.add_secure_port(f"{host}:{port}", credentials)
        else:
            self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise RuntimeError(f"weight relay: cannot bind {host}:{port} (rollout.peer_port)")
        self.endpoint = f"{host}:{self.port}"

    def start(self) -> PeerServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=1).wait()

    def hold(self, version: int, manifest: Manifest, flat: torch.Tensor) -> None:
        """The engine now holds `version` (in `flat`, on the CPU; other devices are not served)."""
        with self._lock:
            self._held = Held(version, manifest, flat) if flat.device.type == "cpu" else None

    def StreamSnapshot(
        self, request: pb.StreamSnapshotRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.SnapshotChunk]:
        if self.roles is not None:
            try:
                self.roles.check(STREAM_SNAPSHOT, context)
            except PermissionDenied as exc:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, exc.message)
        held = self._held
        if held is None or (request.version and request.version != held.version):
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"this engine does not hold version {request.version or 'any'} "
                f"(it holds {held.version if held else 'none'}); ask weight-sync",
            )
        assert held is not None
        chunk_bytes = max(request.chunk_bytes or DEFAULT_CHUNK_BYTES, 64 * 1024)
        flat = held.flat.numpy()

        def pieces() -> Iterator[Any]:
            for at in range(0, len(flat), chunk_bytes):
                if self._held is not held:  # the engine moved on: its buffer may be rewritten
                    context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"version {held.version} was replaced while it was streamed",
                    )
                yield flat[at : at + chunk_bytes].data

        for chunk in iter_chunks(
            held.version, pieces(), chunk_bytes=chunk_bytes, manifest_first=held.manifest
        ):
            if wait := self.pacer.delay(len(chunk.data)):
                time.sleep(wait)
            self.bytes_sent += len(chunk.data)
            yield chunk
