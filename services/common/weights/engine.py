"""Engine side of weight sync: the client a rollout replica runs beside its engine.

`EngineClient` registers the engine with the weight-sync service, keeps it alive with heartbeats
(long polls, so an update is learnt of at once), receives each version over the transport the
service instructs, hands it whole to the engine (`load(tensors, version)`, or `apply(instruction)`
for an engine that receives by itself, as an SGLang server joins a broadcast group) and reports it
loaded. Updates pushed to the replica (`RolloutService.NotifyWeightsUpdate`) come in through
`submit(instruction)`.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import torch

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
from kuberl.common.channels import DEFAULT_MAX_MESSAGE_BYTES, sync_channel
from kuberl.common.logs import get_logger
from kuberl.common.weights.chunks import DEFAULT_CHUNK_BYTES
from kuberl.common.weights.manifest import Manifest
from kuberl.common.weights.peer import PeerServer
from kuberl.common.weights.transports import (
    BufferPool,
    Receiver,
    make_receiver,
    transport_name,
    transport_value,
)
from kuberl.common.weights.transports.cuda_ipc import gpu_uuid
from kuberl.common.weights.transports.snapshot import download_snapshot

log = get_logger(__name__)

#: Versions `EngineClient.history` remembers.
HISTORY_KEPT = 64
#: `load(named_tensors, version)`: swap the engine's weights to these tensors (all at once).
LoadFn = Callable[[dict[str, torch.Tensor], int], None]
#: `apply(instruction)`: receive and load a version by the engine's own means (SGLang).
ApplyFn = Callable[[pb.UpdateInstruction], None]


class EngineClient:
    """One engine's membership in the weight-sync pool. Thread-safe; call `start()` once.

    The engine swaps only after a version's last byte arrived, so it never holds a mix of two.
    Versions are received into a double buffer (`BufferPool`) reused across versions: the engine
    serves the version it holds while the next arrives, and after the first two versions
    nothing is allocated. A pushed update the client already has is ignored.
    """

    def __init__(
        self,
        address: str,
        *,
        load: LoadFn | None = None,
        apply: ApplyFn | None = None,
        engine_id: str = "",
        endpoint: str = "",
        transports: Sequence[str] = ("shm", "gloo", "snapshot"),
        device: str = "cpu",
        host: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        gpu: str | None = None,
        shm_in_place: bool = False,
        ranks: int = 1,
        peer_host: str = "",
        peer_bytes_per_second: float = 0.0,
        job: str = "",
        peer_port: int = 0,
    ) -> None:
        """`gpu`: the UUID of the engine's GPU, which decides CUDA IPC eligibility (None: looked
        up from `device`; "" on the CPU). `shm_in_place`: over `shm`, `load` gets views of the
        service's shared-memory file itself (read-only for the engine, no copy), valid until
        the next `load`: for engines that copy into their own parameters anyway, or that serve
        from the views and switch to each new dict at load. `ranks`: how many ranks the engine
        joins a broadcast group with, from the instruction's `rank` up (an SGLang server joins
        with each tensor-parallel rank: its tp size); the relay sizes the group by it.
        `peer_host`: serve the held version to other engines on this address, at `peer_port`
        (0: a free one; weight-sync's relay tree, `weight_sync.relay_fanout`); "" serves nobody;
        at most
        `peer_bytes_per_second` (0: no cap), to `job`'s engines only under roles."""
        if ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {ranks}")
        if (load is None) == (apply is None):
            raise ValueError("give exactly one of load (tensors in this process) or apply")
        self.address = address
        self.engine_id = engine_id
        self.endpoint = endpoint
        self.transports: list[Any] = [transport_value(t) for t in transports]
        self.device = device
        self.shm_in_place = shm_in_place
        self.ranks = ranks
        self.gpu_uuid = gpu_uuid(device) if gpu is None else gpu
        self.host = host or socket.gethostname()
        self.chunk_bytes = chunk_bytes
        self.heartbeat_seconds = 2.0
        self._load, self._apply = load, apply
        self._channel = sync_channel(address, max(max_message_bytes, 2 * chunk_bytes))
        self._stub = pb_grpc.WeightSyncServiceStub(self._channel)
        self._cond = threading.Condition()
        self._version = 0
        self._busy = 0  # version being received, 0 when idle
        self._queued: pb.UpdateInstruction | None = None
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        #: Receive memory reused across versions, and one receiver per transport (the shm
        #: receiver keeps its mapping of the service's files between versions).
        self._buffers = BufferPool()
        self._receivers: dict[int, Receiver] = {}
        self._receive_lock = threading.Lock()  # one version at a time into the spare buffer
        #: Last error of a failed update (for the replica's status page).
        self.last_error = ""
        #: (version, transport name) of every version loaded, oldest first.
        #: The last versions loaded and how they came, newest last (bounded: a job loads many).
        self.history: deque[tuple[int, str]] = deque(maxlen=HISTORY_KEPT)
        #: Transport of the update being delivered to `load` right now.
        self.current_transport = ""
        self.peer = (
            PeerServer(peer_host, max_message_bytes, peer_bytes_per_second, job, peer_port)
            if peer_host
            else None
        )

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int:
        """The version the engine holds now (0 before the first); stamp it on trajectories."""
        return self._version

    def register(self) -> int:
        """Join the pool; returns the service's current version (the engine catches up to it)."""
        info = pb.EngineInfo(
            engine_id=self.engine_id,
            endpoint=self.endpoint,
            transports=self.transports,
            device=self.device,
            host=self.host,
            loaded_version=self._version,
            gpu_uuid=self.gpu_uuid,
            shm_in_place=self.shm_in_place,
            ranks=self.ranks,
            peer_endpoint=self.peer.endpoint if self.peer is not None else "",
        )
        answer = self._stub.RegisterEngine(pb.RegisterEngineRequest(engine=info), timeout=30)
        self.engine_id = answer.engine_id
        self.heartbeat_seconds = answer.heartbeat_seconds or self.heartbeat_seconds
        log.info("engine.registered", engine_id=self.engine_id, current=answer.current_version)
        if answer.HasField("pending"):
            self.submit(answer.pending)
        return int(answer.current_version)

    def start(self) -> int:
        """Register, then heartbeat and receive updates in background threads."""
        if self.peer is not None:
            self.peer.start()
        current = self.register()
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._work_loop, "receive")):
            thread = threading.Thread(target=target, name=f"weight-sync-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return current

    def wait_for_version(self, version: int, timeout: float | None = None) -> bool:
        """Block until the engine holds `version` or later; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._version < version:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def submit(self, instruction: pb.UpdateInstruction) -> bool:
        """Queue an update (from a heartbeat or a push); False if it is not newer than what the
        engine holds or is already receiving. A newer queued update replaces an older one."""
        with self._cond:
            newest = max(self._version, self._busy, self._queued.version if self._queued else 0)
            if instruction.version <= newest:
                return False
            self._queued = instruction
            self._cond.notify_all()
            return True

    def sync_now(self, timeout: float | None = None) -> int:
        """Download and load the latest version by snapshot right now (blocking); returns it."""
        with self._receive_lock:
            version, manifest, flat = download_snapshot(
                self.address, 0, engine_id=self.engine_id, chunk_bytes=self.chunk_bytes,
                timeout_s=timeout, allocate=self._buffers,
            )  # fmt: skip
            if version > self._version:
                self.current_transport = "snapshot"
                self._deliver(version, manifest, flat)
        return self._version

    def stop(self, leave: bool = True) -> None:
        """Stop the background threads; `leave` tells the service the engine is going."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        if leave and self.engine_id:
            try:
                self._stub.LeaveEngine(pb.LeaveEngineRequest(engine_id=self.engine_id), timeout=5)
            except grpc.RpcError as exc:
                log.warning("engine.leave_failed", code=exc.code().name)
        for thread in self._threads:
            thread.join(timeout=self.heartbeat_seconds + 5)
        if self.peer is not None:
            self.peer.stop()
        self._channel.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals

    def _heartbeat_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                answer = self._stub.Heartbeat(
                    pb.HeartbeatRequest(
                        engine_id=self.engine_id,
                        loaded_version=self._version,
                        wait_seconds=self.heartbeat_seconds,
                    ),
                    timeout=self.heartbeat_seconds + 10,
                )
                if self._stopping.is_set():
                    return
                if not answer.known:
                    log.warning("engine.unknown_to_service", engine_id=self.engine_id)
                    self.register()
                elif answer.HasField("pending") and not self.submit(answer.pending):
                    # Already receiving (or holding) it. The service answers at once while an
                    # update is assigned, so asking again straight away would spin against the
                    # relay for as long as the update takes.
                    self._wait_for_progress()
            except grpc.RpcError as exc:
                if self._stopping.is_set():
                    return
                log.warning("engine.heartbeat_failed", code=exc.code().name)
                self._stopping.wait(self.heartbeat_seconds)

    def _wait_for_progress(self) -> None:
        """Until the update being received or queued changes, or half a heartbeat has passed
        (still in time for the service's liveness check)."""
        deadline = time.monotonic() + self.heartbeat_seconds / 2
        with self._cond:
            busy, queued = self._busy, self._queued
            while not self._stopping.is_set() and self._busy == busy and self._queued is queued:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def _work_loop(self) -> None:
        while True:
            with self._cond:
                while self._queued is None and not self._stopping.is_set():
                    self._cond.wait()
                if self._stopping.is_set():
                    return
                instruction, self._queued = self._queued, None
                assert instruction is not None
                self._busy = instruction.version
                self._cond.notify_all()
            try:
                self._update(instruction)
            finally:
                with self._cond:
                    self._busy = 0
                    self._cond.notify_all()

    def _update(self, instruction: pb.UpdateInstruction) -> None:
        name = transport_name(instruction.transport)
        started = time.perf_counter()
        log.info("engine.update_started", version=instruction.version, transport=name)
        self.current_transport = name
        try:
            if self._apply is not None:
                self._apply(instruction)
                self._set_version(instruction.version)
            else:
                receiver = self._receivers.get(instruction.transport)
                if receiver is None:
                    receiver = self._receivers[instruction.transport] = make_receiver(
                        instruction.transport, device=self.device, address=self.address,
                        engine_id=self.engine_id, chunk_bytes=self.chunk_bytes,
                        shm_in_place=self.shm_in_place,
                    )  # fmt: skip
                with self._receive_lock:
                    manifest, flat = receiver.receive(instruction, self._buffers)
                    # `sync_now` may have loaded a newer version meanwhile: never go back.
                    if instruction.version > self._version:
                        self._deliver(instruction.version, manifest, flat)
            ok, error = True, ""
        except Exception as exc:  # any failure is reported; the service retries by snapshot
            ok, error = False, f"{type(exc).__name__}: {exc}"
            self.last_error = error
            log.warning("engine.update_failed", version=instruction.version, error=error)
        seconds = time.perf_counter() - started
        try:
            self._stub.ReportLoaded(
                pb.ReportLoadedRequest(
                    engine_id=self.engine_id,
                    version=instruction.version,
                    ok=ok,
                    error=error,
                    load_seconds=seconds,
                ),
                timeout=30,
            )
        except grpc.RpcError as exc:
            log.warning("engine.report_failed", code=exc.code().name)
        if ok:
            log.info(
                "engine.update_loaded", version=instruction.version, transport=name,
                seconds=round(seconds, 4),
            )  # fmt: skip

    def _deliver(self, version: int, manifest: Manifest, flat: torch.Tensor) -> None:
        assert self._load is not None
        self._load(manifest.views(flat), version)
        self._buffers.hold(flat)
        if self.peer is not None:
            self.peer.hold(version, manifest, flat)
        self._set_version(version)

    def _set_version(self, version: int) -> None:
        with self._cond:
            self.history.append((version, self.current_transport or "snapshot"))
            self._version = max(self._version, version)
            self._cond.notify_all()
