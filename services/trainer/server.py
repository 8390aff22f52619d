"""`kuberl serve trainer`: the trainer process, alone or as one rank of a torchrun world.

Every rank trains; only rank 0 serves the gRPC `TrainerService` (GetStatus, CheckpointNow) and
talks to the buffer and weight-sync. Under `torchrun --nproc-per-node N -m kuberl.cli serve
trainer --config job.yaml`, `create_service` on a rank other than 0 runs the training loop to
the end itself and leaves the process with its exit code, never binding a port.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import TYPE_CHECKING

import grpc

from kuberl.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from kuberl.common.channels import wait_for_dependency
from kuberl.common.config import JobConfig
from kuberl.common.errors import FailedPrecondition, Unavailable
from kuberl.common.logs import get_logger
from kuberl.common.server import Service
from kuberl.trainer.distributed import leave  # `kuberl serve trainer` leaves through it too

if TYPE_CHECKING:
    from kuberl.trainer.loop import Trainer

log = get_logger(__name__)

# How long rank 0 waits at start for the buffer to report SERVING.
DEPENDENCY_WAIT_SECONDS = 300.0


def buffer_endpoint(config: JobConfig) -> str | None:
    """The buffer's endpoint when this mode reads from it (the rule of `Trainer._connect`)."""
    tc = config.trainer
    return config.endpoints.buffer if tc.mode != "sft" or tc.sft_data is None else None


class _Servicer(trainer_pb2_grpc.TrainerServiceServicer):
    """Its methods run only once `start()` has returned (the bootstrap's start gate answers
    UNAVAILABLE before): the model is loaded and the trainer set up."""

    def __init__(self, service: TrainerService) -> None:
        self.service = service

    def _trainer(self) -> Trainer:
        assert self.service.trainer is not None, "set up by start(), before the gate opens"
        return self.service.trainer

    async def GetStatus(
        self, request: trainer_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.GetStatusResponse:
        s = self._trainer().status
        return trainer_pb2.GetStatusResponse(
            mode=s.mode,
            step=s.step,
            total_steps=s.total_steps,
            policy_version=s.policy_version,
            epoch=s.epoch,
            world_size=s.world_size,
            last_checkpoint=s.last_checkpoint,
            metrics=dict(s.metrics),
            finished=s.finished,
        )

    async def CheckpointNow(
        self, request: trainer_pb2.CheckpointNowRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.CheckpointNowResponse:
        trainer = self._trainer()
        if trainer.status.finished:
            raise FailedPrecondition(
                f"the job has finished; its last checkpoint is {trainer.status.last_checkpoint!r}"
            )
        status = trainer.status
        before = status.checkpoints_answered
        trainer.checkpoint_request.set()

        def wait() -> None:
            with trainer.checkpoint_done:
                while status.checkpoints_answered == before and not (
                    status.finished or status.error
                ):
                    trainer.checkpoint_done.wait(1.0)

        await asyncio.to_thread(wait)
        if status.checkpoints_answered == before:  # not answered since the request: say why
            if status.error:
                raise Unavailable(f"training failed before the checkpoint: {status.error}")
            raise FailedPrecondition(
                "the job finished before a checkpoint could be taken; its last checkpoint is "
                f"{status.last_checkpoint!r}"
            )
        path, step = status.saved  # the checkpoint's own step, not the trainer's now
        return trainer_pb2.CheckpointNowResponse(path=path, step=step)


class TrainerService(Service):
    """Rank 0's service. `start()` joins the process group while it waits for the buffer to
    report SERVING, so pods and local processes may start in any order (weight-sync may come
    later: a publish that fails is retried); then it loads the model and builds the DeepSpeed
    engine (health stays NOT_SERVING until then), then trains on a background thread while the
    event loop answers RPCs. After the job's last step the trainer keeps answering for
    `linger_seconds` (so a supervisor reads the final status), then stops itself like on
    SIGTERM: exit 0. SIGTERM stops training after the current step; during the start it ends
    the wait for the buffer at once (a model still loading is left behind:
    `kuberl.common.server`), also exit 0. A training error exits non-zero, the error logged."""

    name = "trainer"
    service_names = (trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name,)

    def __init__(self, config: JobConfig) -> None:
        self.config = config
        self.trainer: Trainer | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopping = threading.Event()

    def register(self, server: grpc.aio.Server) -> None:
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(_Servicer(self), server)

    async def start(self) -> None:
        from kuberl.trainer.distributed import collective_timeout_seconds, init_distributed
        from kuberl.trainer.loop import Trainer

        # Weight-sync is not waited for: training goes on without it and a publish that
        # failed is retried (tests/reliability/test_trainer_publish_retry.py).
        buffer = buffer_endpoint(self.config)
        joining = asyncio.ensure_future(
            asyncio.to_thread(init_distributed, collective_timeout_seconds(self.config))
        )
        if buffer:
            await wait_for_dependency("buffer", buffer, DEPENDENCY_WAIT_SECONDS)
        trainer = Trainer(self.config, await joining)
        self.trainer = trainer
        await asyncio.to_thread(trainer.setup)
        self._thread = threading.Thread(target=self._train, name="trainer", daemon=True)
        self._thread.start()

    def _train(self) -> None:
        assert self.trainer is not None
        try:
            self.trainer.run()
        except BaseException as exc:
            self._error = exc
            self.trainer.status.error = f"{type(exc).__name__}: {exc}"
            log.exception("trainer.failed")
        if not self._stopping.is_set():
            if self._error is None:
                time.sleep(self.config.trainer.linger_seconds)
            os.kill(os.getpid(), signal.SIGTERM)  # drain the server and exit like on SIGTERM

    async def stop(self) -> None:
        self._stopping.set()
        if self.trainer is not None:
            self.trainer.stop_event.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 600)
        if self._error is not None:
            raise RuntimeError(f"training failed: {self._error}") from self._error


def run_worker(config: JobConfig) -> int:
    """A rank other than 0: train to the end, no server. Returns the exit code."""
    from kuberl.trainer.distributed import collective_timeout_seconds, init_distributed
    from kuberl.trainer.loop import Trainer

    trainer = Trainer(config, init_distributed(collective_timeout_seconds(config)))
    signal.signal(signal.SIGTERM, lambda *_: trainer.stop_event.set())
    trainer.setup()
    trainer.run()
    return 0


def create_service(config: JobConfig) -> TrainerService:
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        leave(run_worker(config))
    return TrainerService(config)
