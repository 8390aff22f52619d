"""`TrainerService.CheckpointNow` against the training thread's side of the handshake.

The servicer is driven directly with a stand-in for the trainer: only the attributes the
handshake uses (`status`, `checkpoint_request`, `checkpoint_done`), with a thread playing the
training loop. The whole trainer answering CheckpointNow while it trains is
tests/integration/test_trainer_sft_resume.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from kuberl.api.trainer.v1 import trainer_pb2
from kuberl.common.errors import FailedPrecondition, Unavailable
from kuberl.trainer.control import Status
from kuberl.trainer.server import _Servicer


def _trainer() -> SimpleNamespace:
    return SimpleNamespace(
        status=Status(ready=True),
        checkpoint_request=threading.Event(),
        checkpoint_done=threading.Condition(),
    )


def _call(trainer: SimpleNamespace, loop_side) -> trainer_pb2.CheckpointNowResponse:  # type: ignore[no-untyped-def]
    """CheckpointNow while `loop_side(trainer)` runs on a thread once the request is set."""

    def training_loop() -> None:
        deadline = time.monotonic() + 10
        while not trainer.checkpoint_request.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)
        loop_side(trainer)

    thread = threading.Thread(target=training_loop, daemon=True)
    thread.start()
    servicer = _Servicer(SimpleNamespace(trainer=trainer))  # type: ignore[arg-type]
    try:
        return asyncio.run(
            asyncio.wait_for(servicer.CheckpointNow(trainer_pb2.CheckpointNowRequest(), None), 10)  # type: ignore[arg-type]
        )
    finally:
        thread.join(10)


def _save(trainer: SimpleNamespace, path: str, step: int) -> None:
    """What `Trainer._checkpoint` does to the handshake: clear the request first, then (once
    written) set `saved`, count, notify."""
    trainer.checkpoint_request.clear()
    trainer.status.saved = (path, step)
    trainer.status.checkpoints_answered += 1
    with trainer.checkpoint_done:
        trainer.checkpoint_done.notify_all()


def test_the_answer_pairs_a_checkpoints_path_with_its_own_step() -> None:
    def loop_side(trainer: SimpleNamespace) -> None:
        _save(trainer, "/ckpt/step-000001", 1)
        # The trainer goes on before the server reads the status: step 2.
        trainer.status.step = 2

    response = _call(_trainer(), loop_side)
    assert (response.path, response.step) == ("/ckpt/step-000001", 1)


def _finish(trainer: SimpleNamespace) -> None:
    """What `Trainer.run` does at its end."""
    trainer.status.finished = True
    with trainer.checkpoint_done:
        trainer.checkpoint_done.notify_all()


def test_a_training_failure_while_waiting_answers_unavailable_instead_of_hanging() -> None:
    def loop_side(trainer: SimpleNamespace) -> None:
        trainer.status.error = "RuntimeError: boom"  # Trainer.run records it, then finishes
        _finish(trainer)

    with pytest.raises(Unavailable, match="training failed before the checkpoint: RuntimeError"):
        _call(_trainer(), loop_side)


def test_a_job_that_ends_without_the_checkpoint_answers_failed_precondition() -> None:
    # The data ran out (or a stop came) before the trainer took the request: the last
    # checkpoint is older than the request, so it is named, not returned as the answer.
    trainer = _trainer()
    trainer.status.saved = ("/ckpt/step-000004", 4)
    with pytest.raises(FailedPrecondition, match="finished before a checkpoint.*step-000004"):
        _call(trainer, _finish)


def test_the_final_checkpoint_of_a_job_that_ends_meanwhile_is_the_answer() -> None:
    def loop_side(trainer: SimpleNamespace) -> None:
        _save(trainer, "/ckpt/step-000010", 10)
        _finish(trainer)

    response = _call(_trainer(), loop_side)
    assert (response.path, response.step) == ("/ckpt/step-000010", 10)
