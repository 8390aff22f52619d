"""The rollout replica as a service (`kuberl serve rollout`): engine, loop and control API.

`start()` resolves the job's model (`kuberl.common.modelbuild.resolve_model`: `model.path`, or a
locally built one), builds the engine (`rollout.engine`), waits for the buffer and the reward
service, registers with weight-sync and catches up to its current version (so a replica joining
mid-job never generates with stale initial weights), probes the `python` tool's sandbox when
the job uses it, then starts `RolloutWorker.run`. Health says SERVING only after all of that.
`stop()` (after SIGTERM) drains: no new leases, in-flight prompts finish within
`rollout.drain_seconds` or are released to the buffer. A SIGTERM during the start interrupts
it, its waits included; `stop()` then closes only what had been set up.

The `RolloutService` RPCs: `GetStatus`; `Pause` / `Resume`; `Drain` (drain, answer, then exit
as on SIGTERM); `NotifyWeightsUpdate` (weight-sync's push of an update instruction, queued in
the weight-sync engine client, which also learns of updates by its heartbeat long poll).
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from kuberl.api.reward.v1 import reward_pb2_grpc
from kuberl.api.rollout.v1 import rollout_pb2 as pb
from kuberl.api.rollout.v1 import rollout_pb2_grpc
from kuberl.common.buffer_client import BufferStub
from kuberl.common.channels import aio_channel, wait_for_dependency
from kuberl.common.config import JobConfig
from kuberl.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from kuberl.common.logs import get_logger
from kuberl.common.server import Service
from kuberl.rollout import metrics as m
from kuberl.rollout.engine import Engine, create_engine
from kuberl.rollout.worker import RolloutWorker

log = get_logger(__name__)

STATES = {
    "starting": pb.REPLICA_STATE_STARTING,
    "running": pb.REPLICA_STATE_RUNNING,
    "paused": pb.REPLICA_STATE_PAUSED,
    "updating_weights": pb.REPLICA_STATE_UPDATING_WEIGHTS,
    "draining": pb.REPLICA_STATE_DRAINING,
}
DEPENDENCY_WAIT_SECONDS = 300.0
#: The catch-up to weight-sync's version is waited for in slices this long: a SIGTERM during
#: the start leaves no thread blocked for the whole `rollout.catch_up_seconds`.
CATCH_UP_SLICE_SECONDS = 0.5


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """The control API. Its methods run only once `start()` has returned (the bootstrap's start
    gate answers UNAVAILABLE before), so the engine and the worker exist."""

    def __init__(self, service: RolloutService) -> None:
        self.service = service

    def _worker(self) -> RolloutWorker:
        assert self.service.worker is not None, "set by start(), before the gate opens"
        return self.service.worker

    def _engine(self) -> Engine:
        assert self.service.engine is not None, "set by start(), before the gate opens"
        return self.service.engine

    async def GetStatus(
        self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatusResponse:
        worker = self._worker()
        return pb.GetStatusResponse(
            replica_id=self.service.replica_id,
            engine=self.service.config.rollout.engine.kind,
            state=STATES[worker.state],
            policy_version=self._engine().version,
            prompts_in_flight=worker.prompts_in_flight,
            groups_put=worker.groups_put,
            generated_tokens=worker.generated_tokens,
        )

    async def Pause(
        self, request: pb.PauseRequest, context: grpc.aio.ServicerContext
    ) -> pb.PauseResponse:
        return pb.PauseResponse(aborted=await self._worker().pause(request.abort_in_flight))

    async def Resume(
        self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResumeResponse:
        await self._worker().resume()
        return pb.ResumeResponse()

    async def Drain(
        self, request: pb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainResponse:
        if not math.isfinite(request.timeout_seconds) or request.timeout_seconds < 0:
            raise InvalidArgument(
                f"timeout_seconds must be a finite number >= 0, got {request.timeout_seconds}"
            )
        timeout = request.timeout_seconds or self.service.config.rollout.drain_seconds
        finished, released = await self._worker().drain(timeout)
        # Then leave as on SIGTERM (the bootstrap's handler stops the server and the service).
        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
        return pb.DrainResponse(finished=finished, released=released)

    async def NotifyWeightsUpdate(
        self, request: pb.NotifyWeightsUpdateRequest, context: grpc.aio.ServicerContext
    ) -> pb.NotifyWeightsUpdateResponse:
        client = self.service.weights
        if client is None:
            raise FailedPrecondition(
                "this replica does not take weight updates (rollout.weight_sync is false)"
            )
        if not request.HasField("instruction") or request.instruction.version <= 0:
            raise InvalidArgument("instruction.version must be > 0")
        accepted = client.submit(request.instruction)
        return pb.NotifyWeightsUpdateResponse(
            accepted=accepted, policy_version=self._engine().version
        )


class RolloutService(Service):
    name = "rollout"
    service_names = (pb.DESCRIPTOR.services_by_name["RolloutService"].full_name,)

    def __init__(self, config: JobConfig) -> None:
        self.config = config
        self.replica_id = config.rollout.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self.engine: Engine | None = None
        self.worker: RolloutWorker | None = None
        self.weights: Any = None  # kuberl.common.weights.EngineClient
        self._channels: list[grpc.aio.Channel] = []
        self._run: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def register(self, server: grpc.aio.Server) -> None:
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutServicer(self), server)

    async def start(self) -> None:
        from kuberl.common.modelbuild import load_tokenizer, resolve_model

        self._loop = asyncio.get_running_loop()
        config = self.config
        model_path = await asyncio.to_thread(resolve_model, config)
        tokenizer = await asyncio.to_thread(load_tokenizer, model_path)
        self.engine = await asyncio.to_thread(create_engine, config, model_path, self.replica_id)
        await self.engine.start()
        log.info(
            "replica.engine_ready",
            replica=self.replica_id,
            engine=config.rollout.engine.kind,
            model=str(model_path),
        )
        endpoints = config.endpoints
        await asyncio.gather(
            wait_for_dependency("buffer", endpoints.buffer, DEPENDENCY_WAIT_SECONDS),
            wait_for_dependency("reward", endpoints.reward, DEPENDENCY_WAIT_SECONDS),
        )
        buffer_channel, reward_channel = (
            aio_channel(endpoints.buffer),
            aio_channel(endpoints.reward),
        )
        self._channels = [buffer_channel, reward_channel]
        if config.rollout.weight_sync:
            await self._join_weight_sync()
        m.ENGINE_VERSION.set(self.engine.version)
        self.worker = RolloutWorker(
            config,
            self.engine,
            tokenizer,
            buffer=BufferStub(buffer_channel),
            reward=reward_pb2_grpc.RewardServiceStub(reward_channel),
            replica_id=self.replica_id,
        )
        if self.worker.ctx.tools is not None:  # the python tool's sandbox, probed before serving
            await self.worker.ctx.tools.start()
        self._run = asyncio.create_task(self.worker.run())
        log.info("replica.started", replica=self.replica_id, version=self.engine.version)

    async def stop(self) -> None:
        # Also after a start that SIGTERM interrupted: only what was set up is released.
        if self.worker is not None:
            await self.worker.drain()
        if self._run is not None:
            self._run.cancel()
        if self.weights is not None:
            await asyncio.to_thread(self.weights.stop)
        if self.engine is not None:
            await self.engine.close()
        if self.worker is not None and self.worker.ctx.tools is not None:
            self.worker.ctx.tools.close()  # gives back the python tool's sandbox uids
        for channel in self._channels:
            await channel.close()

    # -- weight sync ----------------------------------------------------------------------------

    async def _join_weight_sync(self) -> None:
        from kuberl.common.weights import EngineClient

        assert self.engine is not None
        config = self.config
        port = config.rollout.server.port
        endpoint = f"{socket.gethostname()}:{port}" if port else ""
        if self.engine.kind in ("torch", "simulated"):
            device = getattr(config.rollout.engine, "device", "cpu")
            # On a GPU the trainer's buckets can be copied device to device (same GPU) or
            # broadcast over NCCL; every engine can take shared memory, gloo and snapshots.
            gpu = ("cuda_ipc", "nccl") if device.startswith("cuda") else ()
            # The torch engine serves from the tensors it is given until the next load, so over
            # shared memory it reads the service's file in place: no copy on the engine's side,
            # one copy of the weights per host.
            self.weights = EngineClient(
                config.endpoints.weight_sync,
                load=self._load_tensors,
                engine_id=self.replica_id,
                endpoint=endpoint,
                transports=(*gpu, "shm", "gloo", "snapshot"),
                device=device,
                shm_in_place=True,
                # Versions it holds pass on to other engines (weight-sync's relay tree).
                peer_host=_pod_address() if config.weight_sync.relay_fanout else "",
                peer_bytes_per_second=config.weight_sync.snapshot_bytes_per_second,
                job=config.job.name,
                peer_port=config.rollout.peer_port,
            )
        elif config.model.lora is not None:
            # LoRA: each version is an adapter of a few MB, received here (shared memory on
            # the weight-sync host, else gloo or a snapshot download) and handed to SGLang as a
            # PEFT folder; the server's base weights never change. The folder is written from
            # the tensors at once, so over shm they are read in place.
            self.weights = EngineClient(
                config.endpoints.weight_sync,
                load=self._load_adapter,
                engine_id=self.replica_id,
                endpoint=endpoint,
                transports=("shm", "gloo", "snapshot"),
                device="cpu",
                shm_in_place=True,
            )
        else:
            tp_size = getattr(config.rollout.engine, "tp_size", 1)
            # CUDA IPC when the server shares the trainer's GPU (one tensor-parallel rank: each
            # set of handles is opened once). The GPU is this process's current CUDA device, as
            # for the torch engine: SGLang's when the replica launched it or shares its
            # CUDA_VISIBLE_DEVICES; with no GPU visible here none is registered and the relay
            # never chooses CUDA IPC.
            ipc = ("cuda_ipc",) if tp_size == 1 else ()
            self.weights = EngineClient(
                config.endpoints.weight_sync,
                apply=self._apply_instruction,
                engine_id=self.replica_id,
                endpoint=endpoint,
                transports=(*ipc, "nccl", "snapshot"),
                device="cuda",
                # SGLang joins a broadcast group with every tensor-parallel rank.
                ranks=tp_size,
            )
        await wait_for_dependency(
            "weight-sync", config.endpoints.weight_sync, DEPENDENCY_WAIT_SECONDS
        )
        current = await asyncio.to_thread(self.weights.start)
        deadline = time.monotonic() + config.rollout.catch_up_seconds
        caught_up = False
        while not caught_up and (left := deadline - time.monotonic()) > 0:
            caught_up = await asyncio.to_thread(
                self.weights.wait_for_version, current, min(CATCH_UP_SLICE_SECONDS, left)
            )
        if not caught_up:
            raise Unavailable(
                f"could not load the current policy version {current} within "
                f"{config.rollout.catch_up_seconds:.0f}s ({self.weights.last_error or 'no error'})"
            )

    def _in_loop(self, version: int, load: Any) -> None:
        """Run a load on the event loop from the weight client's thread, through the worker's
        pause / load / resume when the loop is running."""
        assert self._loop is not None

        async def go() -> None:
            if self.worker is not None:
                await self.worker.apply_weight_update(version, load)
            else:
                await load()
                m.ENGINE_VERSION.set(version)

        asyncio.run_coroutine_threadsafe(go(), self._loop).result()

    def _load_tensors(self, tensors: dict[str, Any], version: int) -> None:
        engine = self.engine
        assert engine is not None
        # EngineClient's tensors stay valid until the next load: the engine serves from them.
        self._in_loop(version, lambda: engine.load_weights(tensors, version, borrow=True))

    def _load_adapter(self, tensors: dict[str, Any], version: int) -> None:
        from kuberl.rollout.engine.sglang import SGLangEngine

        engine = self.engine
        assert isinstance(engine, SGLangEngine)
        self._in_loop(version, lambda: engine.load_adapter(tensors, version))

    def _apply_instruction(self, instruction: Any) -> None:
        from kuberl.api.weight_sync.v1 import weight_sync_pb2 as wpb
        from kuberl.common.weights import download_snapshot, safetensors_header
        from kuberl.rollout.engine.sglang import SGLangEngine

        engine = self.engine
        assert isinstance(engine, SGLangEngine) and self.weights is not None
        version = int(instruction.version)
        if instruction.transport == wpb.TRANSPORT_NCCL:
            self._in_loop(version, lambda: engine.apply_broadcast(instruction))
            return
        if instruction.transport == wpb.TRANSPORT_CUDA_IPC:
            self._in_loop(version, lambda: engine.apply_cuda_ipc(instruction))
            return
        if instruction.transport != wpb.TRANSPORT_SNAPSHOT:
            raise NotImplementedError(
                "the sglang engine receives weights by CUDA IPC, NCCL broadcast or snapshot, "
                f"not {wpb.Transport.Name(instruction.transport)}"
            )
        got, manifest, flat = download_snapshot(
            self.config.endpoints.weight_sync, version, engine_id=self.weights.engine_id
        )
        folder = Path(self.config.rollout.engine.snapshot_dir)  # type: ignore[union-attr]
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".safetensors", delete=False) as f:
            f.write(safetensors_header(manifest))
            f.write(flat.numpy().data)  # a view: no second copy of the model
        try:
            self._in_loop(got, lambda: engine.apply_snapshot(Path(f.name), got, folder))
        finally:  # moved into place when applied; a model-sized file never stays behind
            Path(f.name).unlink(missing_ok=True)


def _pod_address() -> str:
    """The address other pods reach this one at (its hostname's, the pod IP on Kubernetes)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def create_service(config: JobConfig) -> RolloutService:
    """The entrypoint `kuberl serve rollout` calls."""
    return RolloutService(config)
