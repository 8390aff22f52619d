"""Rank 0's side of the buffer conversation about training batches: GetBatch, Ack and hold.
A trained batch is acknowledged by the next GetBatch; while no checkpoint has its step
(`ack_after_checkpoint`) it is *held* instead (kept out of redelivery and of the backpressure
window) and acknowledged right after the next checkpoint. A restarted trainer asks for its held
batches back (`reopen_held`): one its checkpoint names (`Cursor.trained_batches`) is only
acknowledged, one trained after it is trained again, so every group is in the final weights
exactly once. On ranks other than 0 (no buffer) the calls do nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from kuberl.api.buffer.v1 import buffer_pb2
from kuberl.api.common.v1 import trajectory_pb2
from kuberl.common import metrics as prom
from kuberl.common.config import TrainerConfig
from kuberl.common.logs import get_logger
from kuberl.common.trajectory import Group
from kuberl.trainer.batch import Batch, Rejection, usable_groups
from kuberl.trainer.checkpoint import Cursor
from kuberl.trainer.control import MSG_BATCH, MSG_EXHAUSTED, MSG_WAIT
from kuberl.trainer.sft import samples_from_groups

log = get_logger(__name__)

BATCHES = prom.counter("kuberl_trainer_batches_total", "Batches received", ["kind"])
ALREADY_TRAINED = prom.counter(
    "kuberl_trainer_already_trained_batches_total",
    "Re-delivered batches the checkpoint had already trained on: acknowledged, not trained",
)

# What acknowledging the held batches after a checkpoint may take, per try of each batch (one
# after a checkpoint, while the other ranks wait; five at the job's end).
COMMIT_SECONDS = 20.0
# How long one `fetch` waits for a batch before it answers MSG_WAIT.
FETCH_ROUND_SECONDS = 60.0


def receive(body: bytes, sft: bool, cursor: Cursor, vocab_size: int) -> Batch:
    """The batch of a GetBatchResponse (serialized, as broadcast by rank 0): the groups the
    model can train on and that no step trained before (by the cursor's group keys), as
    sequences. A batch whose id the cursor names is settled by the caller, untrained."""
    resp = buffer_pb2.GetBatchResponse.FromString(body)
    known = sft or resp.batch_id in cursor.trained_batches
    rejected: list[Rejection] = []
    groups = usable_groups(
        [Group.from_proto(g) for g in resp.groups],
        vocab_size,
        same_size=not sft,
        trained=() if known else set(cursor.trained_groups),
        rejected=rejected,
    )
    return Batch(
        samples=samples_from_groups(groups),
        groups=groups,
        batch_id=resp.batch_id,
        redelivered=resp.redelivered,
        rejected=rejected,
        dropped=dict(resp.dropped),
    )


class BatchDelivery:
    """Batches in, acknowledgements and holds out (rank 0)."""

    def __init__(
        self,
        tc: TrainerConfig,
        buffer: Any | None,
        is_main: bool,
        stop: threading.Event | None = None,
    ) -> None:
        self.tc = tc
        #: A BufferService stub (rank 0 of a job that reads the buffer), else None.
        self.buffer = buffer
        self.is_main = is_main
        #: Set when the job stops: a wait between retries ends at once.
        self.stop = stop or threading.Event()
        #: The last trained batch, acknowledged (or held) by the next GetBatch.
        self.unacked = ""
        self.unacked_hold = False
        #: Batches trained since the last checkpoint, held in the buffer until the next one.
        self.uncommitted: list[str] = []
        #: Stream kinds whose held batches this trainer has asked back (its first GetBatch).
        self.reopened: set[int] = set()

    @property
    def stub(self) -> Any:
        assert self.buffer is not None, "rank 0 of a job that reads the buffer"
        return self.buffer

    def fetch(self, sft: bool, policy_version: int, interrupt: Callable[[], bytes | None]) -> bytes:
        """The next control message for the other ranks: MSG_BATCH and the serialized
        GetBatchResponse, MSG_EXHAUSTED, MSG_WAIT after a round with nothing to train on, or
        whatever `interrupt` answers (stop, checkpoint, publish again) before each try. Carries
        the last trained batch's acknowledgement; a buffer that cannot be reached is retried."""
        kind = trajectory_pb2.STREAM_KIND_SFT if sft else trajectory_pb2.STREAM_KIND_TRAIN
        deadline = time.monotonic() + FETCH_ROUND_SECONDS
        while time.monotonic() < deadline:
            tag = interrupt()
            if tag is not None:
                return tag
            request = buffer_pb2.GetBatchRequest(
                num_groups=self.tc.groups_per_step,
                max_staleness=self.tc.max_staleness,
                current_version=policy_version,
                consumer="trainer",
                wait_seconds=self.tc.batch_wait_seconds,
                kind=kind,
                ack_batch_id=self.unacked,
                hold=self.unacked_hold,
                reopen_held=kind not in self.reopened,
            )
            try:
                raw = self.stub.GetBatch.with_call(
                    request, timeout=self.tc.batch_wait_seconds + 30
                )[0]
                self.unacked = ""
                self.reopened.add(kind)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND and self.unacked:
                    # The buffer does not know the batch (its Redis lost it): nothing to ack.
                    log.error("buffer.ack_unknown", batch_id=self.unacked, error=exc.details())
                    self.unacked = ""
                    continue
                log.warning("buffer.get_batch_failed", error=str(exc)[:300])
                self.stop.wait(1.0)
                continue
            except Exception as exc:  # buffer restarting: wait and retry, never lose the step
                log.warning("buffer.get_batch_failed", error=str(exc)[:300])
                self.stop.wait(1.0)
                continue
            if raw.groups:
                BATCHES.labels("redelivered" if raw.redelivered else "new").inc()
                if raw.redelivered:
                    log.info("batch.redelivered", batch_id=raw.batch_id)
                return MSG_BATCH + raw.SerializeToString()
            if raw.exhausted:
                return MSG_EXHAUSTED
        return MSG_WAIT

    # ------------------------------------------------------------------ after a step

    def should_hold(self, batch_id: str, unsaved: bool) -> bool:
        """Whether a batch trained now is held rather than acknowledged: `unsaved`, no
        checkpoint has its step yet. A held batch is noted for `commit_held`."""
        hold = bool(
            batch_id
            and self.is_main
            and self.tc.ack_after_checkpoint
            and self.tc.checkpoint_every
            and unsaved
        )
        if hold and batch_id not in self.uncommitted:
            self.uncommitted.append(batch_id)
        return hold

    def trained(self, batch_id: str, unsaved: bool) -> None:
        """A step trained `batch_id`: it goes (acknowledged or held) with the next GetBatch.
        A batch still pending from before (a step read from a file left none) goes now."""
        if not self.is_main:
            return
        self.flush()
        self.unacked, self.unacked_hold = batch_id, self.should_hold(batch_id, unsaved)

    def skipped(self, batch_id: str, unsaved: bool) -> None:
        """A batch with no group to train on: settled like a trained one, held while steps
        are unsaved, because the groups the buffer left out as trained since the last
        checkpoint must come back if those steps die with this process."""
        self.ack(batch_id, hold=self.should_hold(batch_id, unsaved))

    def settle_trained(self, batch_id: str) -> None:
        """A re-delivered batch the weights hold already (trained and checkpointed, then the
        Ack was lost): acknowledged, not trained again; held when trained since the last
        checkpoint (re-delivered on its ack timeout before this trainer held it)."""
        ALREADY_TRAINED.inc()
        log.warning("batch.already_trained", batch_id=batch_id)
        self.ack(batch_id, hold=batch_id in self.uncommitted)

    def flush(self) -> None:
        """Acknowledge (or hold) the last trained batch now instead of with the next GetBatch."""
        batch_id, self.unacked = self.unacked, ""
        self.ack(batch_id, hold=self.unacked_hold)

    def ack(
        self, batch_id: str, hold: bool = False, attempts: int = 5, timeout: float = 30.0
    ) -> bool:
        """Acknowledge (or hold) a batch; False when it could not be. Such a batch is
        re-delivered by the buffer later: recognised by its id, it is settled then."""
        if not batch_id or not self.is_main:
            return True
        for attempt in range(attempts):
            try:
                request = buffer_pb2.AckRequest(batch_id=batch_id, hold=hold)
                self.stub.Ack(request, timeout=min(timeout, 30.0))
                return True
            except Exception as exc:
                if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.NOT_FOUND:
                    # The buffer does not know the batch (its Redis lost it): nothing to ack.
                    log.error("buffer.ack_unknown", batch_id=batch_id, error=exc.details())
                    return True
                log.warning("buffer.ack_failed", batch_id=batch_id, attempt=attempt, error=str(exc))
            if attempt + 1 < attempts:
                time.sleep(min(2**attempt, 10))
        log.error("buffer.ack_gave_up", batch_id=batch_id)
        return False

    def commit_held(self, attempts: int = 1) -> None:
        """After a checkpoint: acknowledge the batches held since the previous one (one that
        could not be is tried again after the next checkpoint and at the job's end); the last
        trained batch, still to be sent, is acknowledged rather than held. Within
        COMMIT_SECONDS per try: the other ranks wait in their next collective meanwhile."""
        if not self.is_main:
            return
        self.unacked_hold = False
        deadline = time.monotonic() + COMMIT_SECONDS * attempts
        left = []
        for batch_id in (b for b in self.uncommitted if b != self.unacked):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.ack(batch_id, attempts=attempts, timeout=remaining):
                left.append(batch_id)
        if left:
            log.warning("buffer.commit_deferred", batches=len(left))
        self.uncommitted = left

    def acknowledge(self, batch_ids: Iterable[str]) -> None:
        """Acknowledge batches a checkpoint holds, once each, without waiting long
        (idempotent: one acknowledged before, or forgotten by the buffer, changes nothing)."""
        for batch_id in batch_ids:
            self.ack(batch_id, attempts=1, timeout=5.0)

    # ------------------------------------------------------------------ the buffer's view

    def set_policy_version(self, version: int) -> None:
        """Tell the buffer the trainer's policy version (its staleness filter reads it)."""
        if not self.is_main or self.buffer is None:
            return
        try:
            self.stub.SetPolicyVersion(
                buffer_pb2.SetPolicyVersionRequest(version=version), timeout=30
            )
        except Exception as exc:  # a version conflict after a resume is harmless
            log.warning("buffer.set_version_failed", error=str(exc)[:300])

    def policy_version(self) -> int:
        """The policy version the buffer knows (0 when unreachable)."""
        if self.buffer is None:
            return 0
        try:
            stats = self.stub.GetStats(buffer_pb2.GetStatsRequest(), timeout=10)
            return int(stats.policy_version)
        except Exception as exc:
            log.warning("buffer.unreachable_at_resume", error=str(exc)[:300])
            return 0
