"""The weight-sync service: versioned weights from the trainer to an elastic pool of engines.

`kuberl serve weight_sync` runs it. Control plane: engines register, heartbeat (a long poll that
returns as soon as an update is pending) and leave; one silent for `missed_heartbeats` beats is
dropped. The trainer announces a version (`Publish`, above the latest committed one, else
FAILED_PRECONDITION; a new announcement replaces one never completed),
hands over its bytes — written straight into this service's shared memory on the same host
(`CommitPublish`), or streamed in checked chunks (`UploadSnapshot`) — and returns: the trainer never
waits for engines. The service is then the relay: for every engine present and idle it starts an
update over the first transport of `weight_sync.transports` the engine can use — `cuda_ipc` (the
engine is on the trainer's host and GPU and the trainer exported CUDA IPC handles of its GPU
buckets: one set per such engine), `nccl` (the relay has a GPU, `weight_sync.device`, and the engine
another one), `shm` (same host: the one copy the trainer wrote, which every engine maps read-only
and copies from in parallel), `gloo`, else `snapshot` (`StreamSnapshot`). Broadcasts (`nccl`,
`gloo`: the same code, backend and device as parameters) use a group formed for this version and
this engine, the relay at rank 0, one broadcast per bucket. One group per engine is the choice that
makes a slow or dead engine fail alone: in a shared gloo group one dead member breaks the broadcast
for everyone. Only control messages (heartbeat answers, reports) go through gRPC on these paths; the
bytes never do. An engine that joins after a version's fan-out began, or whose update failed or
timed out (`broadcast_timeout_seconds`, counted once whether the reaper or the relay's own
collective timeout sees it first), catches up by snapshot and takes broadcasts from the next version
on; one that timed out is most likely still receiving, so it gets later versions by snapshot, and
no retry of the same one, until it reports back. `GetStatus` and the metrics say who holds what.

A restart does not lose the current version: each committed version is sealed on disk beside its
segment (its SHA-256 and manifest, written off the event loop), and `start` takes back the newest
version whose payload still checks out (`VersionStore(restore=True)`) before the service reports
SERVING, so engines that register get it and `Publish` keeps refusing versions not above it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from kuberl.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
from kuberl.common import metrics
from kuberl.common.channels import aio_channel
from kuberl.common.config import JobConfig, WeightSyncConfig
from kuberl.common.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from kuberl.common.logs import get_logger
from kuberl.common.roles import IdentitySource, identity_source, require_instance
from kuberl.common.server import Service
from kuberl.common.weights.chunks import ChunkReceiver, CorruptSnapshot, Pacer, iter_chunks
from kuberl.common.weights.manifest import Manifest
from kuberl.common.weights.transports.names import transport_name, transport_value
from kuberl.weight_sync.registry import Assignment, Engine, Registry
from kuberl.weight_sync.relay import SERVICE, Relay
from kuberl.weight_sync.store import DigestMismatch, StoredVersion, VersionStore

if TYPE_CHECKING:
    from kuberl.common.weights.transports.broadcast import BroadcastSender

log = get_logger(__name__)


def _import_torch_transports() -> None:
    """Load the transports that move tensors (and with them torch)."""
    from kuberl.common.weights.transports import broadcast, cuda_ipc  # noqa: F401


SERVICE_NAME = "kuberl.weight_sync.v1.WeightSyncService"
#: Longest a heartbeat long poll is held, whatever the engine asks.
MAX_POLL_SECONDS = 30.0
#: The pause before an engine whose update failed is sent the current version again, doubled
#: for every failure in a row up to `RETRY_MAX_SECONDS`, so an engine that cannot load a version
#: (its model does not match it) is not resent it in a tight loop.
RETRY_FIRST_SECONDS = 0.5
RETRY_MAX_SECONDS = 30.0


class _Metrics:
    def __init__(self) -> None:
        p = "kuberl_weight_sync"
        self.version = metrics.gauge(f"{p}_version", "Latest complete policy version")
        self.publish_seconds = metrics.histogram(
            f"{p}_publish_seconds",
            "From Publish to the version being complete here (what the trainer waits)",
            ["transport"],
        )
        self.update_seconds = metrics.histogram(
            f"{p}_engine_update_seconds",
            "From a version's fan-out to an engine reporting it loaded",
            ["transport"],
        )
        self.bytes = metrics.counter(
            f"{p}_bytes_total", "Payload bytes moved", ["transport", "direction"]
        )
        self.bandwidth = metrics.gauge(
            f"{p}_bandwidth_bytes_per_second",
            "Bandwidth of the last completed transfer",
            ["transport", "direction"],
        )
        self.engines = metrics.gauge(f"{p}_engines", "Engines holding each version", ["version"])
        self.engines_behind = metrics.gauge(
            f"{p}_engines_behind",
            "Engines by how many versions they are behind the current one",
            ["behind"],
        )
        self.joins = metrics.counter(f"{p}_engine_joins_total", "Engines registered")
        self.leaves = metrics.counter(
            f"{p}_engine_leaves_total", "Engines gone (left, or dropped after silence)", ["reason"]
        )
        self.timeouts = metrics.counter(
            f"{p}_timeouts_total",
            "Engines timed out: of the pool (heartbeat) or of one version's update (update)",
            ["kind"],
        )
        self.update_failures = metrics.counter(
            f"{p}_engine_update_failures_total", "Updates an engine failed", ["transport"]
        )
        self.rejected = metrics.counter(
            f"{p}_rejected_total", "Requests refused, by reason", ["reason"]
        )
        self.notify_failures = metrics.counter(
            f"{p}_notify_failures_total", "Best-effort NotifyWeightsUpdate pushes that failed"
        )
        self.relayed = metrics.counter(
            f"{p}_relayed_bytes_total", "Snapshot bytes engines streamed to each other (relay)"
        )


#: Values of the `engines_behind` gauge's `behind` label: "ahead" is an engine holding a version
#: newer than the current one (a restarted service that came back at an older sealed version).
BEHIND_BUCKETS = ("ahead", "0", "1", "2", "3+")


def behind_bucket(versions_behind: int) -> str:
    if versions_behind < 0:
        return "ahead"
    return str(versions_behind) if versions_behind < 3 else "3+"


@dataclass
class _Announced:
    version: int
    transport: int
    started: float
    #: Where CUDA IPC handles of this version can be opened (when the trainer offered it).
    trainer_host: str = ""
    gpu_uuid: str = ""


def _default_advertise_host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class WeightSyncService(Service, pb_grpc.WeightSyncServiceServicer):
    name = "weight_sync"
    service_names = (SERVICE_NAME,)
    # start() restores the last sealed version (about 1 s per GB); the server bootstrap answers
    # every call UNAVAILABLE meanwhile, so no handler runs before `store` is open.
    starting = "restoring its last version"

    def __init__(
        self,
        config: WeightSyncConfig,
        job: str = "kuberl",
        address: str = "",
        identities: IdentitySource | None = None,
    ) -> None:
        self.config = config
        self.job = job
        #: Under roles an engine acts only under its own identity (kuberl.common.roles).
        self.identities = identities
        self.hostname = socket.gethostname()
        self.advertise_host = config.advertise_host or _default_advertise_host()
        #: host:port engines use for StreamSnapshot; empty = the address they registered at.
        self.address = address
        self.offered = [transport_value(t) for t in config.transports]
        #: The relay's GPU for NCCL broadcasts ("" without one: no engine gets nccl).
        self.relay_gpu = ""
        self.registry = Registry(config.heartbeat_seconds, config.missed_heartbeats)
        self.relay = Relay(config.relay_fanout)
        self.pacer = Pacer(config.snapshot_bytes_per_second)
        self.store: VersionStore | None = None
        self.metrics = _Metrics()
        self.current = 0
        self.announced: dict[int, _Announced] = {}
        self.latest_announced = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        #: One seal at a time: a version committed while another is hashed waits, and is skipped
        #: if a later one was committed meanwhile (only the newest matters after a restart).
        self._seal_lock = asyncio.Lock()

    # ------------------------------------------------------------------ lifecycle

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_WeightSyncServiceServicer_to_server(self, server)

    def _store_dir(self) -> Path:
        shm = Path(self.config.shm_dir)
        if shm.parent.is_dir() and os.access(shm.parent, os.W_OK):
            return shm / self.job
        return Path(self.config.snapshot_dir) / self.job

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        torch_transports = {pb.TRANSPORT_GLOO, pb.TRANSPORT_NCCL, pb.TRANSPORT_CUDA_IPC}
        if torch_transports & set(self.offered):
            # Their modules need torch: imported now, off the loop, rather than by the first
            # update that uses them, which would stall every heartbeat for a second or two.
            await asyncio.to_thread(_import_torch_transports)
        # Hashing what a crashed predecessor left takes ~1 s per GB: in a thread, while health
        # still says NOT_SERVING.
        self.store = await asyncio.to_thread(
            VersionStore,
            self._store_dir(),
            self.config.retain_versions,
            restore=True,
            max_version_bytes=self.config.max_version_bytes,
        )
        restored = self.store.latest()
        if restored is not None:
            self.current = restored.version
            self.metrics.version.set(restored.version)
            self._refresh_engine_gauges()
            log.info(
                "weight_sync.restored", version=restored.version, path=restored.path,
                bytes=restored.manifest.total_bytes, tensors=len(restored.manifest.entries),
            )  # fmt: skip
        if pb.TRANSPORT_NCCL in self.offered and self.config.device.startswith("cuda"):
            from kuberl.common.weights.transports.cuda_ipc import gpu_uuid

            self.relay_gpu = gpu_uuid(self.config.device)
            if not self.relay_gpu:
                log.warning("weight_sync.no_cuda", device=self.config.device, nccl="off")
        self._reaper = asyncio.create_task(self._reap_forever())
        log.info(
            "weight_sync.ready",
            store=str(self.store.directory),
            shm=self.store.in_shared_memory,
            max_version_bytes=self.store.max_version_bytes,
            transports=",".join(self.config.transports),
            advertise_host=self.advertise_host,
            device=self.config.device,
            nccl=bool(self.relay_gpu),
            version=self.current,
        )

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        self.relay = Relay(0)  # nobody is admitted while the assignments end
        for engine in self.registry.engines.values():
            self._end_assignment(engine)
        if self.store is not None:
            self.store.close()

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ engines

    def _own_engine(self, context: grpc.aio.ServicerContext, engine_id: str) -> None:
        if self.identities is not None:
            try:
                require_instance(self.identities, context, engine_id, "engine")
            except PermissionDenied:
                self.metrics.rejected.labels("foreign_engine").inc()
                raise

    async def RegisterEngine(
        self, request: pb.RegisterEngineRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterEngineResponse:
        self._own_engine(context, request.engine.engine_id)
        for t in request.engine.transports:
            if transport_name(t) == "unspecified":
                self.metrics.rejected.labels("bad_transport").inc()
                raise InvalidArgument(f"engine transports: unknown transport value {t}")
        engine, new = self.registry.register(request.engine)
        engine.wake = engine.wake or asyncio.Event()
        self.relay.join(engine.engine_id, request.engine.peer_endpoint)
        # A version whose fan-out already began reaches this engine by snapshot.
        engine.catch_up_below = self.current + 1
        if new:
            self.metrics.joins.inc()
        log.info(
            "engine.joined", engine_id=engine.engine_id, host=engine.host, device=engine.device,
            transports=",".join(transport_name(t) for t in engine.transports),
            loaded=engine.loaded_version, current=self.current,
        )  # fmt: skip
        self._catch_up(engine)
        self._refresh_engine_gauges()
        answer = pb.RegisterEngineResponse(
            engine_id=engine.engine_id,
            heartbeat_seconds=self.config.heartbeat_seconds,
            current_version=self.current,
        )
        if engine.assignment is not None:
            answer.pending.CopyFrom(engine.assignment.instruction)
        return answer

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        self._own_engine(context, request.engine_id)
        engine = self.registry.get(request.engine_id)
        if engine is None:
            return pb.HeartbeatResponse(current_version=self.current, known=False)
        self.registry.touch(engine)
        self._note_loaded(engine, request.loaded_version)
        assignment = engine.assignment
        if assignment is not None and request.loaded_version >= assignment.version:
            # It holds what it was sent: its ReportLoaded was lost. Kept open, the assignment
            # was handed out again at every heartbeat and left the engine out of the next
            # version's fan-out until it timed out.
            self._count_relayed(engine, assignment.version)
            self.relay.holds(engine.engine_id, request.loaded_version)
            self._end_assignment(engine)
            self._unpin(engine, request.loaded_version)
        self._catch_up(engine)
        wait = min(request.wait_seconds, MAX_POLL_SECONDS)
        if engine.assignment is None and wait > 0:
            engine.wake.clear()
            engine.polls += 1
            try:
                await asyncio.wait_for(engine.wake.wait(), wait)
            except TimeoutError:
                pass
            finally:
                engine.polls -= 1
                self.registry.touch(engine)
            if self.registry.get(engine.engine_id) is not engine:
                return pb.HeartbeatResponse(current_version=self.current, known=False)
        answer = pb.HeartbeatResponse(current_version=self.current, known=True)
        if engine.assignment is not None:
            answer.pending.CopyFrom(engine.assignment.instruction)
        return answer

    async def LeaveEngine(
        self, request: pb.LeaveEngineRequest, context: grpc.aio.ServicerContext
    ) -> pb.LeaveEngineResponse:
        self._own_engine(context, request.engine_id)
        engine = self.registry.remove(request.engine_id)
        if engine is not None:
            self._end_assignment(engine)
            self.relay.leave(engine.engine_id)
            self._unpin(engine)
            engine.wake.set()
            self.metrics.leaves.labels("leave").inc()
            self._refresh_engine_gauges()
            log.info("engine.left", engine_id=engine.engine_id, loaded=engine.loaded_version)
        return pb.LeaveEngineResponse()

    async def ReportLoaded(
        self, request: pb.ReportLoadedRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportLoadedResponse:
        self._own_engine(context, request.engine_id)
        engine = self.registry.get(request.engine_id)
        if engine is None:
            self.metrics.rejected.labels("unknown_engine").inc()
            raise NotFound(f"engine {request.engine_id!r} is not registered (dropped?); register")
        self.registry.touch(engine)
        assignment, overdue = engine.assignment, engine.overdue
        # A late report on the update it was timed out of (counted then, as a timeout).
        late = overdue is not None and overdue.version == request.version
        source = overdue if late else assignment
        transport = transport_name(source.transport) if source else "unknown"
        if overdue is not None and request.version >= overdue.version:
            engine.overdue = None
        relayed_from = self.relay.source_of(engine.engine_id)
        if request.ok:
            self._note_loaded(engine, request.version)
            self.relay.holds(engine.engine_id, request.version)
            engine.last_error = ""
            if assignment is not None and assignment.version == request.version:
                seconds = time.monotonic() - assignment.started
                self._count_relayed(engine, request.version)
                self.metrics.update_seconds.labels(transport).observe(seconds)
                # Broadcasts are counted by the relay's sender and snapshots by StreamSnapshot
                # (which serves other downloads too); shm and CUDA IPC move no bytes through
                # the service, so the engine's report is where they are known to have arrived.
                if assignment.transport in (pb.TRANSPORT_SHM, pb.TRANSPORT_CUDA_IPC):
                    self._count_out(transport, self._version_bytes(request.version), seconds)
            log.info(
                "engine.loaded", engine_id=engine.engine_id, version=request.version,
                transport=transport, seconds=round(request.load_seconds, 4),
            )  # fmt: skip
        else:
            if relayed_from is not None:
                self.relay.failed_source(relayed_from)
            engine.last_error = request.error
            engine.failures += 1
            pause = min(RETRY_FIRST_SECONDS * 2 ** (engine.failures - 1), RETRY_MAX_SECONDS)
            engine.retry_at = time.monotonic() + pause
            if not late:
                self.metrics.update_failures.labels(transport).inc()
            log.warning(
                "engine.update_failed", engine_id=engine.engine_id, version=request.version,
                transport=transport, after_timeout=late, error=request.error,
            )  # fmt: skip
        if assignment is not None and assignment.version <= request.version:
            self._end_assignment(engine)
        # The engine is done reading what it was sent up to this version (even after a timeout).
        self._unpin(engine, request.version)
        if not request.ok:
            # Retry by snapshot: the failed transport may be what is broken.
            engine.catch_up_below = max(engine.catch_up_below, request.version + 1)
        self._catch_up(engine)
        self._refresh_engine_gauges()
        return pb.ReportLoadedResponse()

    def _note_loaded(self, engine: Engine, version: int) -> None:
        if engine.overdue is not None and version >= engine.overdue.version:
            engine.overdue = None
        if version > engine.loaded_version:
            engine.loaded_version = version
            engine.failures, engine.retry_at = 0, 0.0
            self._refresh_engine_gauges()

    # ------------------------------------------------------------------ publishing

    async def Publish(
        self, request: pb.PublishRequest, context: grpc.aio.ServicerContext
    ) -> pb.PublishResponse:
        version = request.version
        if version <= 0:
            self.metrics.rejected.labels("bad_version").inc()
            raise InvalidArgument(f"version must be a positive integer, got {version}")
        if version <= self.current:
            self.metrics.rejected.labels("stale_version").inc()
            raise FailedPrecondition(
                f"version {version} is not above the latest published version {self.current}; "
                "versions must increase"
            )
        offered = set(request.transports) or {pb.TRANSPORT_SNAPSHOT}
        assert self.store is not None
        if (
            pb.TRANSPORT_SHM in offered
            and pb.TRANSPORT_SHM in self.offered
            and request.trainer_host == self.hostname
            and self.store.in_shared_memory
        ):
            transport = pb.TRANSPORT_SHM
        elif pb.TRANSPORT_SNAPSHOT in offered:
            transport = pb.TRANSPORT_SNAPSHOT
        else:
            self.metrics.rejected.labels("no_common_transport").inc()
            raise InvalidArgument(
                "the trainer must offer shm (on this service's host) or snapshot (a gRPC "
                f"upload); it offered {sorted(transport_name(t) for t in offered)}"
            )
        # One announcement at a time, the latest: one that was never completed (a retry of the
        # same version, or any client's Publish that sent no bytes) cannot block this one.
        superseded = sorted(self.announced)
        for old in superseded:
            self.announced.pop(old)
            self.store.discard(old)
        if superseded and superseded != [version]:
            log.warning("publish.superseded", version=version, announced=superseded)
        self.latest_announced = version
        announced = _Announced(version, transport, time.monotonic())
        ipc_engines = 0
        if (
            pb.TRANSPORT_CUDA_IPC in offered
            and pb.TRANSPORT_CUDA_IPC in self.offered
            and request.gpu_uuid
        ):
            announced.trainer_host, announced.gpu_uuid = request.trainer_host, request.gpu_uuid
            # The engines the fan-out would give a set to if it ran now: a set nobody opens
            # keeps the trainer's GPU memory behind it allocated (torch's IPC limbo).
            ipc_engines = sum(
                1
                for e in self.registry.engines.values()
                if self._fan_out_transport(e, version, announced) == pb.TRANSPORT_CUDA_IPC
            )
        self.announced[version] = announced
        send = pb.UpdateInstruction(version=version, transport=transport)
        send.manifest.bucket_bytes = self.config.bucket_bytes
        if transport == pb.TRANSPORT_SHM:
            send.handles_json = json.dumps({"path": self.store.reserve(version)})
        log.info(
            "publish.announced", version=version, transport=transport_name(transport),
            trainer_host=request.trainer_host, cuda_ipc_engines=ipc_engines,
        )  # fmt: skip
        return pb.PublishResponse(
            version=version,
            send=send,
            upload_snapshot=transport == pb.TRANSPORT_SNAPSHOT,
            cuda_ipc_engines=ipc_engines,
        )

    @staticmethod
    def _colocated(engine: Engine, announced: _Announced) -> bool:
        """The engine can open the trainer's CUDA IPC handles: same host, same GPU."""
        return (
            pb.TRANSPORT_CUDA_IPC in engine.transports
            and bool(announced.gpu_uuid)
            and engine.gpu_uuid == announced.gpu_uuid
            and engine.host == announced.trainer_host
        )

    def _announced(self, version: int, transport: int) -> _Announced:
        announced = self.announced.get(version)
        if announced is None or announced.transport != transport:
            self.metrics.rejected.labels("not_announced").inc()
            raise FailedPrecondition(
                f"version {version} was not announced for {transport_name(transport)} by "
                f"Publish, or another announcement superseded it (latest {self.latest_announced})"
            )
        return announced

    def _forget(self, version: int) -> None:
        """A refused version was never adopted: drop its announcement and bytes, so that the
        trainer's retry of the same version is announced again instead of refused as stale."""
        assert self.store is not None
        self.announced.pop(version, None)
        self.store.discard(version)
        self.latest_announced = max([self.current, *self.announced])

    async def UploadSnapshot(
        self, request_iterator: AsyncIterator[pb.SnapshotChunk], context: grpc.aio.ServicerContext
    ) -> pb.UploadSnapshotResponse:
        assert self.store is not None
        fd = -1
        version = 0
        receiver: ChunkReceiver | None = None
        handles = ""
        # The trainer's manifest rides on the last chunk, so the bytes before it are bounded by
        # what the store can keep, not by the manifest: without this bound, a stream that never
        # sent one filled the folder (tmpfs: the pod's memory) under the versions kept there.
        limit = self.store.max_version_bytes

        def write(offset: int, data: bytes) -> None:
            view = memoryview(data)
            while view.nbytes:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n

        try:
            async for chunk in request_iterator:
                if receiver is None:
                    # Set only once this stream owns the version: a refused first chunk once
                    # forgot (and deleted) another publish's announcement of it.
                    self._announced(chunk.version, pb.TRANSPORT_SNAPSHOT)
                    version = chunk.version
                    fd = self.store.open_upload(version)
                    receiver = ChunkReceiver(write, version=version)
                elif version not in self.announced:
                    # A later version was announced meanwhile: stop writing this one's bytes
                    # (they went on into its deleted file to the last chunk).
                    self.metrics.rejected.labels("superseded").inc()
                    raise FailedPrecondition(
                        f"version {version} was superseded by the announcement of "
                        f"{self.latest_announced} while it was sent"
                    )
                if receiver.received + len(chunk.data) > limit:
                    self.metrics.rejected.labels("too_large").inc()
                    raise InvalidArgument(
                        f"upload of version {version} refused at {receiver.received} bytes: a "
                        f"version may have at most {limit} bytes here ({self._bound_reason(limit)})"
                    )
                receiver.feed(chunk)
                handles = chunk.cuda_ipc_handles_json or handles
            if receiver is None:
                raise CorruptSnapshot("empty upload: no chunk was sent")
            manifest = receiver.finish()
        except CorruptSnapshot as exc:
            self.metrics.rejected.labels("corrupt_snapshot").inc()
            if version:
                self._forget(version)
            raise InvalidArgument(f"upload of version {version} rejected: {exc}") from None
        except BaseException:
            if version:
                self._forget(version)
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        engine_ids = self._commit(
            version, manifest, uploaded=True, cuda_ipc_handles=handles, known_sha256=receiver.sha256
        )
        return pb.UploadSnapshotResponse(
            version=version, bytes_received=receiver.received, engine_ids=engine_ids
        )

    async def CommitPublish(
        self, request: pb.CommitPublishRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitPublishResponse:
        self._announced(request.version, pb.TRANSPORT_SHM)
        try:
            manifest = Manifest.from_proto(request.manifest)
        except ValueError as exc:
            self.metrics.rejected.labels("bad_manifest").inc()
            self._forget(request.version)
            raise InvalidArgument(f"version {request.version}: {exc}") from None
        engine_ids = self._commit(
            request.version,
            manifest,
            uploaded=False,
            sha256=request.sha256,
            cuda_ipc_handles=request.cuda_ipc_handles_json,
        )
        return pb.CommitPublishResponse(version=request.version, engine_ids=engine_ids)

    def _commit(
        self,
        version: int,
        manifest: Manifest,
        *,
        uploaded: bool,
        sha256: str = "",
        cuda_ipc_handles: str = "",
        known_sha256: str = "",
    ) -> list[str]:
        """Adopt an announced version's bytes, fan it out, seal it; `sha256` is checked here,
        `known_sha256` was checked already (an upload's stream digest)."""
        assert self.store is not None
        announced = self.announced.pop(version, None)
        if announced is None or version <= self.current:
            self.store.discard(version)
            self.metrics.rejected.labels("superseded").inc()
            raise FailedPrecondition(
                f"version {version} was superseded by version {self.current} while it was sent"
            )
        ipc_sets = []
        if cuda_ipc_handles:
            from kuberl.common.weights.transports.cuda_ipc import split_cuda_ipc

            try:
                ipc_sets = split_cuda_ipc(cuda_ipc_handles, manifest)
                if ipc_sets[0].gpu_uuid != announced.gpu_uuid:
                    raise ValueError(
                        f"handles are for GPU {ipc_sets[0].gpu_uuid!r}, Publish announced "
                        f"{announced.gpu_uuid!r}"
                    )
            except ValueError as exc:
                self.metrics.rejected.labels("bad_cuda_ipc_handles").inc()
                self._forget(version)
                raise InvalidArgument(f"version {version}: {exc}") from None
        try:
            stored = self.store.commit(version, manifest, uploaded, sha256)
        except DigestMismatch as exc:
            self.metrics.rejected.labels("corrupt_snapshot").inc()
            self._forget(version)
            raise InvalidArgument(str(exc)) from None
        except ValueError:
            self.metrics.rejected.labels("bad_payload").inc()
            self._forget(version)
            raise
        stored.cuda_ipc_sets = ipc_sets
        stored.sha256 = stored.sha256 or known_sha256
        stored.cuda_ipc_host, stored.cuda_ipc_gpu = announced.trainer_host, announced.gpu_uuid
        seconds = time.monotonic() - announced.started
        transport = transport_name(announced.transport)
        self.current = version
        self.metrics.version.set(version)
        self._refresh_engine_gauges()
        self.metrics.publish_seconds.labels(transport).observe(seconds)
        self.metrics.bytes.labels(transport, "in").inc(manifest.total_bytes)
        if seconds > 0:
            self.metrics.bandwidth.labels(transport, "in").set(manifest.total_bytes / seconds)
        engine_ids = self._fan_out(stored)
        self.store.pin(stored)  # until sealed: its segment is not handed out meanwhile
        self._spawn(self._seal(stored))
        log.info(
            "publish.committed", version=version, transport=transport,
            bytes=manifest.total_bytes, tensors=len(manifest.entries),
            buckets=manifest.num_buckets, seconds=round(seconds, 4), engines=len(engine_ids),
        )  # fmt: skip
        return engine_ids

    async def _seal(self, stored: StoredVersion) -> None:
        """Record `stored` for a restart (off the event loop); the trainer does not wait."""
        assert self.store is not None
        try:
            async with self._seal_lock:
                if stored.version == self.current:
                    await asyncio.to_thread(self.store.seal, stored)
        except OSError as exc:  # stopping (the folder is gone) or a full disk: not fatal
            log.warning("store.seal_failed", version=stored.version, error=str(exc)[:300])
        finally:
            self.store.unpin(stored)

    # ------------------------------------------------------------------ relay

    def _fan_out_transport(
        self, engine: Engine, version: int, ipc: _Announced | None
    ) -> int | None:
        """How the fan-out of `version` updates `engine` (None: it does not, the engine is
        busy or has it); `ipc` says where the version's CUDA IPC handles open, if it has any."""
        if engine.assignment is not None or engine.loaded_version >= version:
            return None
        if version < engine.catch_up_below or engine.overdue is not None:
            return pb.TRANSPORT_SNAPSHOT  # still busy: a broadcast group would wait for it
        return self._choose(engine, ipc)

    def _choose(self, engine: Engine, ipc: _Announced | None) -> int:
        """The first transport of the relay's preference the engine offers and can use now."""
        for transport in self.offered:
            if transport not in engine.transports:
                continue
            if transport == pb.TRANSPORT_CUDA_IPC:
                if ipc is not None and self._colocated(engine, ipc):
                    return transport
            elif transport == pb.TRANSPORT_NCCL:
                # Two ranks of one NCCL group cannot share a GPU ("Duplicate GPU detected").
                if (
                    self.relay_gpu
                    and engine.device.startswith("cuda")
                    and engine.gpu_uuid != self.relay_gpu
                ):
                    return transport
            elif transport == pb.TRANSPORT_SHM:
                assert self.store is not None
                if engine.host == self.hostname and self.store.in_shared_memory:
                    return transport
            elif transport in (pb.TRANSPORT_GLOO, pb.TRANSPORT_SNAPSHOT):
                return transport
        return pb.TRANSPORT_SNAPSHOT

    def _fan_out(self, stored: StoredVersion) -> list[str]:
        started = []
        ipc = None
        if stored.cuda_ipc_sets:
            ipc = _Announced(0, 0, 0, stored.cuda_ipc_host, stored.cuda_ipc_gpu)
        for engine in list(self.registry.engines.values()):
            transport = self._fan_out_transport(engine, stored.version, ipc)
            if transport is None:
                continue
            if transport == pb.TRANSPORT_CUDA_IPC and not stored.cuda_ipc_sets:
                transport = self._choose(engine, None)  # more engines than sets: the next best
            self._assign(engine, stored, transport)
            started.append(engine.engine_id)
        return started

    def _catch_up(self, engine: Engine) -> None:
        """An idle engine behind the current version gets it by snapshot (after a failed update,
        once its pause is over: a heartbeat then sends it)."""
        if engine.assignment is not None or engine.loaded_version >= self.current:
            return
        if time.monotonic() < engine.retry_at:
            return
        if engine.overdue is not None and engine.overdue.version >= self.current:
            # Most likely still receiving it: the client ignores a version it is receiving, so
            # the snapshot would only time out again. It is retried once the engine reports.
            return
        assert self.store is not None
        stored = self.store.latest()
        if stored is not None:
            self._assign(engine, stored, pb.TRANSPORT_SNAPSHOT)

    def _assign(self, engine: Engine, stored: StoredVersion, transport: int) -> None:
        source = SERVICE
        if transport == pb.TRANSPORT_SNAPSHOT:
            relay = self.relay.source(engine.engine_id, stored.version)
            if relay is None:
                return  # every source is busy: assigned when one frees (`_admit_waiting`)
            source = relay
        now = time.monotonic()
        timeout = self.config.broadcast_timeout_seconds
        instruction = pb.UpdateInstruction(
            version=stored.version,
            transport=transport,  # type: ignore[arg-type]
            manifest=stored.manifest.to_proto(),
            deadline_seconds=timeout,
        )
        assignment = Assignment(instruction, started=now, deadline=now + timeout)
        if transport == pb.TRANSPORT_SHM:
            instruction.handles_json = json.dumps({"path": stored.path})
            # Not reused until the engine reports this version, whatever the deadline says: a
            # late copy must never read the next version's bytes.
            assert self.store is not None
            self.store.pin(stored)
            engine.pins.append(stored)
        elif transport == pb.TRANSPORT_CUDA_IPC:
            instruction.handles_json = stored.cuda_ipc_sets.pop(0).to_json()
        elif transport == pb.TRANSPORT_SNAPSHOT:
            # Empty: the address the engine already talks to (right behind a Kubernetes Service).
            instruction.snapshot_endpoint = source or self.address
        elif transport in (pb.TRANSPORT_GLOO, pb.TRANSPORT_NCCL):
            from kuberl.common.weights.transports.broadcast import BroadcastSender

            nccl = transport == pb.TRANSPORT_NCCL
            sender = BroadcastSender(
                backend="nccl" if nccl else "gloo",
                advertise_host=self.advertise_host,
                world_size=1 + engine.ranks,
                group_name=f"kuberl-ws-{self.job}-v{stored.version}-{engine.engine_id}",
                timeout_s=timeout,
                device=self.config.device if nccl else "cpu",
            )
            instruction.group.CopyFrom(sender.group)
            instruction.rank = 1
            assignment.sender = sender
            self._start_broadcast(engine.engine_id, stored, assignment)
        engine.assignment = assignment
        engine.last_transport = transport
        engine.wake.set()
        if self.config.notify_engines and engine.endpoint:
            self._spawn(self._notify(engine.endpoint, instruction))
        log.info(
            "update.assigned", engine_id=engine.engine_id, version=stored.version,
            transport=transport_name(transport),
        )  # fmt: skip

    def _start_broadcast(
        self, engine_id: str, stored: StoredVersion, assignment: Assignment
    ) -> None:
        loop = self._loop
        assert loop is not None and self.store is not None
        sender: BroadcastSender = assignment.sender
        self.store.pin(stored)

        def run() -> None:
            import torch

            started = time.monotonic()
            error = ""
            try:
                sender.send(stored.manifest, torch.from_numpy(stored.flat))
            except Exception as exc:  # a dead or slow peer: only this engine's update fails
                error = f"{type(exc).__name__}: {exc}"
            seconds = time.monotonic() - started
            loop.call_soon_threadsafe(
                self._broadcast_done, engine_id, stored, assignment, error, seconds
            )

        threading.Thread(target=run, name=f"broadcast-{engine_id}", daemon=True).start()

    def _broadcast_done(
        self,
        engine_id: str,
        stored: StoredVersion,
        assignment: Assignment,
        error: str,
        seconds: float,
    ) -> None:
        assert self.store is not None
        self.store.unpin(stored)
        backend = assignment.sender.backend
        if not error:
            self._count_out(backend, stored.manifest.total_bytes, seconds)
            return
        engine = self.registry.get(engine_id)
        current = engine is not None and engine.assignment is assignment
        log.warning(
            "broadcast.failed", engine_id=engine_id, version=stored.version, error=error[:300]
        )
        if time.monotonic() >= assignment.deadline:
            # The sender's collectives time out after `broadcast_timeout_seconds` too, so this
            # is the update's deadline, seen here or by the reaper first: one timeout either way.
            if current:
                assert engine is not None
                self._time_out(engine)
            return
        if current:  # a dead peer: only this engine's update fails, it catches up by snapshot
            assert engine is not None
            # Counted here only while the update is the engine's: one that has reported was
            # counted by its ReportLoaded (a failure was once counted twice).
            self.metrics.update_failures.labels(backend).inc()
            engine.last_error = error[:500]
            self._end_assignment(engine)
            engine.catch_up_below = max(engine.catch_up_below, stored.version + 1)

    def _bound_reason(self, limit: int) -> str:
        """What set the store's bound per version, `limit` (for an upload refused at it)."""
        assert self.store is not None
        if self.store.cap and limit == self.store.cap:
            return f"weight_sync.max_version_bytes={limit}"
        return (
            f"the size of {self.store.directory}'s filesystem shared by the "
            f"weight_sync.retain_versions={self.store.retain} versions kept and the one "
            "being written"
        )

    def _end_assignment(self, engine: Engine) -> None:
        assignment, engine.assignment = engine.assignment, None
        if assignment is not None and assignment.sender is not None:
            assignment.sender.close()
        if self.relay.finished(engine.engine_id) is not None:
            self._admit_waiting()

    def _admit_waiting(self) -> None:
        """Engines waiting for a relay slot take the ones free now (each refused one waits on)."""
        for _ in range(self.relay.waiting_count()):
            engine_id = self.relay.next_waiting()
            engine = self.registry.get(engine_id) if engine_id is not None else None
            if engine is not None:
                self._catch_up(engine)
                if engine.assignment is None and self.relay.is_waiting(engine.engine_id):
                    return  # no slot left

    def _unpin(self, engine: Engine, reported: int | None = None) -> None:
        """Release the shared-memory versions the engine is done with: all (it left), else those
        up to the version it reported, except, for an engine serving from the file in place,
        the version it holds (released when it loads a later one)."""
        assert self.store is not None
        keep = []
        for stored in engine.pins:
            held = engine.shm_in_place and stored.version == engine.loaded_version
            if reported is not None and (held or stored.version > reported):
                keep.append(stored)
            else:
                self.store.unpin(stored)
        engine.pins = keep

    def _retire_held(self, engine: Engine) -> None:
        """A dropped engine (silent, not gone: it may be stalled) keeps the segments it may still
        read: the one it serves from in place, and any it may be copying a later version out of
        (a copying engine stalled mid-copy once had its segment handed to a later version and
        loaded the mix as the earlier one). Such a segment is never rewritten."""
        assert self.store is not None
        for stored in engine.pins:
            serving = engine.shm_in_place and stored.version == engine.loaded_version
            if serving or stored.version > engine.loaded_version:
                self.store.retire(stored.segment)

    def _count_relayed(self, engine: Engine, version: int) -> None:
        """`engine` got `version` from a peer (heard of by its report or, if that was lost, by its
        heartbeat: the assignment ends at whichever comes first)."""
        if self.relay.source_of(engine.engine_id) not in (None, SERVICE):
            self.metrics.relayed.inc(self._version_bytes(version))

    def _count_out(self, transport: str, nbytes: int, seconds: float) -> None:
        self.metrics.bytes.labels(transport, "out").inc(nbytes)
        if seconds > 0:
            self.metrics.bandwidth.labels(transport, "out").set(nbytes / seconds)

    def _version_bytes(self, version: int) -> int:
        assert self.store is not None
        stored = self.store.get(version)
        return stored.manifest.total_bytes if stored else 0

    async def _notify(self, endpoint: str, instruction: pb.UpdateInstruction) -> None:
        try:
            async with aio_channel(endpoint) as channel:
                stub = rollout_pb2_grpc.RolloutServiceStub(channel)
                await stub.NotifyWeightsUpdate(
                    rollout_pb2.NotifyWeightsUpdateRequest(instruction=instruction), timeout=2.0
                )
        except grpc.aio.AioRpcError as exc:
            self.metrics.notify_failures.inc()
            log.debug("notify.failed", endpoint=endpoint, code=exc.code().name)

    # ------------------------------------------------------------------ liveness

    async def _reap_forever(self) -> None:
        period = min(1.0, self.config.heartbeat_seconds / 2)
        while True:
            await asyncio.sleep(period)
            self.reap()

    def reap(self) -> None:
        """Drop silent engines and time out updates past their deadline."""
        for engine in self.registry.expired():
            self.registry.remove(engine.engine_id)
            self._end_assignment(engine)
            self.relay.leave(engine.engine_id)
            self._retire_held(engine)
            self._unpin(engine)
            self.metrics.timeouts.labels("heartbeat").inc()
            self.metrics.leaves.labels("dropped").inc()
            log.warning(
                "engine.dropped", engine_id=engine.engine_id, loaded=engine.loaded_version,
                silent_seconds=round(time.monotonic() - engine.last_seen, 2),
            )  # fmt: skip
            self._refresh_engine_gauges()
        now = time.monotonic()
        for engine in self.registry.engines.values():
            if engine.assignment is not None and now > engine.assignment.deadline:
                self._time_out(engine)

    def _time_out(self, engine: Engine) -> None:
        """End the engine's update at its deadline; the engine is `overdue` until it reports."""
        assignment = engine.assignment
        assert assignment is not None
        self.metrics.timeouts.labels("update").inc()
        log.warning(
            "update.timed_out", engine_id=engine.engine_id, version=assignment.version,
            transport=transport_name(assignment.transport),
        )  # fmt: skip
        engine.last_error = f"timed out of version {assignment.version}"
        self._end_assignment(engine)
        engine.catch_up_below = max(engine.catch_up_below, assignment.version + 1)
        engine.overdue = assignment

    def _refresh_engine_gauges(self) -> None:
        """`engines{version}` exports the versions engines hold now, so each version is a new,
        short-lived series; `engines_behind` sets every bucket, empty ones to 0, so it is the same
        five series for the job's life (what the dashboard and alerts read)."""
        self.metrics.engines.clear()
        behind = dict.fromkeys(BEHIND_BUCKETS, 0)
        for version, count in self.registry.engines_per_version().items():
            self.metrics.engines.labels(str(version)).set(count)
            behind[behind_bucket(self.current - version)] += count
        for bucket, count in behind.items():
            self.metrics.engines_behind.labels(bucket).set(count)

    # ------------------------------------------------------------------ reads

    async def StreamSnapshot(
        self, request: pb.StreamSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SnapshotChunk]:
        assert self.store is not None
        stored = self.store.get(request.version) if request.version else self.store.latest()
        if stored is None:
            self.metrics.rejected.labels("snapshot_not_found").inc()
            raise NotFound(
                f"version {request.version} is not kept here; the latest is {self.current}"
                if request.version
                else "no version has been published yet"
            )
        limit = self.config.server.max_message_bytes - 64 * 1024
        chunk_bytes = min(
            max(request.chunk_bytes or self.config.snapshot_chunk_bytes, 64 * 1024), limit
        )
        flat = stored.flat
        started = time.monotonic()

        def pieces() -> Iterator[memoryview]:
            for at in range(0, len(flat), chunk_bytes):
                yield flat[at : at + chunk_bytes].data

        self.store.pin(stored)
        try:
            for chunk in iter_chunks(
                stored.version, pieces(), chunk_bytes=chunk_bytes, manifest_first=stored.manifest
            ):
                if wait := self.pacer.delay(len(chunk.data)):
                    await asyncio.sleep(wait)
                yield chunk
        finally:
            self.store.unpin(stored)
        self._count_out("snapshot", stored.manifest.total_bytes, time.monotonic() - started)

    async def GetVersion(
        self, request: pb.GetVersionRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetVersionResponse:
        assert self.store is not None
        stored = self.store.get(self.current)
        answer = pb.GetVersionResponse(version=self.current)
        if stored is not None:
            answer.manifest.CopyFrom(stored.manifest.to_proto())
        return answer

    async def GetStatus(
        self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatusResponse:
        now = time.monotonic()
        return pb.GetStatusResponse(
            current_version=self.current,
            engines=[e.info(now) for e in self.registry.engines.values()],
            engines_per_version=self.registry.engines_per_version(),
        )


def create_service(config: JobConfig) -> WeightSyncService:
    """Entry point of `kuberl serve weight_sync`."""
    return WeightSyncService(
        config.weight_sync, job=config.job.name, identities=identity_source(config.tls)
    )
