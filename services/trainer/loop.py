"""The trainer's driver: the job's steps in order, each mechanism behind a named object.

    fetch a batch (rank 0 asks the buffer, every rank receives it: `control`, `delivery`)
    -> advantages and updates (`rl.RLStep`; `sft.SFTStep` for SFT and the warm-up)
    -> policy version + 1 -> checkpoint every `checkpoint_every` steps (`checkpointer`)
    -> acknowledge the batch, or hold it until a checkpoint has its step (`delivery`)
    -> publish the weights every `publish_every` steps (`publishing`)
    -> an eval round every `eval_every` steps (`evaluation`)

The job ends at `total_steps`, when the data runs out, or on a stop (SIGTERM on any rank), with
a checkpoint of the steps not yet saved. Every rank runs this loop; rank 0 alone talks to the
buffer and weight-sync and broadcasts what happens next. `delivery`'s docstring says why every
group is in the final weights exactly once across crashes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from pathlib import Path

from kuberl.common.config import JobConfig
from kuberl.common.logs import get_logger
from kuberl.trainer import checkpoint as ckpt
from kuberl.trainer.batch import Batch
from kuberl.trainer.checkpointer import Checkpointer
from kuberl.trainer.control import (
    MSG_BATCH,
    MSG_CHECKPOINT,
    MSG_EXHAUSTED,
    MSG_PUBLISH,
    MSG_STOP,
    Control,
    Status,
)
from kuberl.trainer.delivery import BatchDelivery, receive
from kuberl.trainer.distributed import DistInfo, broadcast_bytes
from kuberl.trainer.engine import train_dtype
from kuberl.trainer.evaluation import Evaluator
from kuberl.trainer.models import Models
from kuberl.trainer.publishing import PolicyPublisher
from kuberl.trainer.rl import RLStep
from kuberl.trainer.sft import SFTFile, SFTStep
from kuberl.trainer.telemetry import Reporter, TrainedLog, speed
from kuberl.trainer.tracking import Tracking, warm_up_folder

log = get_logger(__name__)


class Trainer:
    """The trainer of one process (every rank builds one)."""

    def __init__(self, config: JobConfig, dist_info: DistInfo, base_dir: Path | None = None):
        self.config = config
        self.tc = config.trainer
        self.dist = dist_info
        self.base = base_dir or Path.cwd()
        self.status = Status(
            mode=self.tc.mode, total_steps=self.tc.total_steps, world_size=dist_info.world_size
        )
        self.control = Control(dist_info, self.status)
        self.cursor = ckpt.Cursor()
        self.models = Models()
        self.delivery = BatchDelivery(self.tc, None, dist_info.is_main, self.control.stop_event)
        self.publisher = PolicyPublisher(config, self.models, dist_info)
        self.checkpoints = Checkpointer(config, dist_info, self.models, self.base)
        self.rl_step = RLStep(config, self.models, dist_info)
        self.sft_step = SFTStep(config, self.models, dist_info)
        self.evaluator = Evaluator(config, dist_info, self.delivery, self.control.stop_event)
        self.reporter = Reporter(dist_info, self.tc.total_steps)
        self.trained_log = TrainedLog.from_env(dist_info.is_main)
        self.sft_file: SFTFile | None = None
        self.stopped = False

    # What the server thread reaches (SIGTERM, CheckpointNow).
    @property
    def stop_event(self) -> threading.Event:
        return self.control.stop_event

    @property
    def checkpoint_request(self) -> threading.Event:
        return self.control.checkpoint_request

    @property
    def checkpoint_done(self) -> threading.Condition:
        return self.control.checkpoint_done

    # ------------------------------------------------------------------ the job

    def run(self) -> None:
        """Train until total_steps (or the data ends, or stop). Collective."""
        try:
            self._run()
            self.delivery.flush()
            if self.checkpoints.holds(self.cursor):
                self.delivery.commit_held(attempts=5)  # what a checkpoint could not acknowledge
        except BaseException as exc:
            # Before `finished`: a CheckpointNow waiting on both must see the failure.
            self.status.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.reporter.close()
            self.status.finished = True
            self.control.notify()

    def _run(self) -> None:
        tc = self.tc
        if tc.mode == "eval":
            self._evaluate()
            return
        if self.cursor.policy_version > 0:
            self._publish()  # engines that started from the base weights catch up
        if tc.mode == "rl" and not self._warm_up():
            return
        if tc.mode == "rl" and self.cursor.step == 0 and self.cursor.eval_round == 0:
            self._evaluate()
        while self.cursor.step < tc.total_steps:
            before = self.cursor.step
            if not self._one_step(sft=tc.mode == "sft"):
                break
            stepped = self.cursor.step != before  # not a checkpoint or an acknowledgement only
            if stepped and self._eval_due():
                self._evaluate()
        if self.stopped:
            log.info("trainer.stopped", step=self.cursor.step)
            return
        if tc.mode == "rl" and not self._eval_due():
            self._evaluate()  # the final weights' round, unless the last step just had one
        if self.cursor.policy_version > 0:
            self.publisher.publish_current(self.cursor.policy_version)  # engines end on these
        self._checkpoint_final()  # the last steps, also when the data ran out first
        log.info("trainer.finished", step=self.cursor.step, version=self.cursor.policy_version)

    def _eval_due(self) -> bool:
        """An RL job's step is a multiple of `eval_every`."""
        tc = self.tc
        return tc.mode == "rl" and bool(tc.eval_every) and self.cursor.step % tc.eval_every == 0

    def _warm_up(self) -> bool:
        """The SFT warm-up of an RL job (`sft_steps`); False when the job ends in it."""
        while self.cursor.sft_step < self.tc.sft_steps:
            if not self._one_step(sft=True):
                if not self.stopped:
                    self._checkpoint_final()  # the warm-up's data ran out: the job ends
                return False
        return True

    def _one_step(self, sft: bool) -> bool:
        """Act on rank 0's next message: mostly a step. False when the job must end."""
        msg, batch = self._next_batch(sft)
        if msg == MSG_STOP:
            self.stopped = True
            self._checkpoint_unsaved()  # a graceful stop (SIGTERM, preemption) keeps its progress
            return False
        if msg == MSG_EXHAUSTED:
            log.info("trainer.data_exhausted", step=self.cursor.step)
            return False
        if msg == MSG_CHECKPOINT:
            self._checkpoint_requested()
            return True
        assert batch is not None
        if batch.batch_id and batch.batch_id in self.cursor.trained_batches:
            self.trained_log.write({"event": "already_trained", "batch_id": batch.batch_id})
            self.delivery.settle_trained(batch.batch_id)
            return True
        if not batch.samples:  # every group was unusable: settled, counted, go on
            self._log_batch("rejected", batch)
            self.delivery.skipped(batch.batch_id, self._unsaved())
            return True
        self._train(batch, sft)
        return True

    def _train(self, batch: Batch, sft: bool) -> None:
        """Train on `batch`, then checkpoint, acknowledge and publish as they fall due."""
        started = time.perf_counter()
        if sft:
            metrics = self.sft_step(batch)
        else:
            metrics = self.rl_step(batch, self.cursor.step, self.cursor.policy_version)
        self._advance(batch, sft)
        seconds = time.perf_counter() - started
        metrics.update(speed(batch, seconds, self.models, self.tc.algorithm, sft, self.dist))
        if self._checkpoint_due(sft):
            self._checkpoint()  # before the batch is acknowledged: see `delivery`
        self.delivery.trained(batch.batch_id, self._unsaved())
        self.delivery.set_policy_version(self.cursor.policy_version)
        if self.cursor.policy_version % self.tc.publish_every == 0:
            self._publish()
            metrics.update(self.publisher.take_metrics())
        metrics["step_seconds"] = time.perf_counter() - started
        self._record(metrics, "sft" if sft else "rl", batch)

    # ------------------------------------------------------------------ batches

    def _next_batch(self, sft: bool) -> tuple[bytes, Batch | None]:
        """Rank 0's next message on every rank, with the batch when it is one."""
        if sft and self.tc.sft_data is not None:  # from the file: every rank reads it
            tag, _ = self.control.receive(None, self._publish)
            return tag, self._file_batch() if tag == MSG_BATCH else None

        def fetch() -> bytes:
            return self.delivery.fetch(sft, self.cursor.policy_version, self._interrupt)

        tag, body = self.control.receive(fetch, self._publish)
        if tag != MSG_BATCH:
            return tag, None
        return tag, receive(body, sft, self.cursor, self.models.vocab_size)

    def _interrupt(self) -> bytes | None:
        """What ends rank 0's wait for a batch: a publish to retry, a stop, a checkpoint."""
        return MSG_PUBLISH if self.publisher.retry_due() else self.control.pending()

    def _file_batch(self) -> Batch:
        assert self.sft_file is not None
        warm_up = self.tc.mode == "rl"
        epoch, batch = self.sft_file.next_batch(
            self.cursor.sft_step if warm_up else self.cursor.step
        )
        if not warm_up:  # an RL job's epoch is its RL data's, not its warm-up's
            self.cursor.epoch = epoch
        return batch

    def _advance(self, batch: Batch, sft: bool) -> None:
        """The cursor past a trained batch (the SFT warm-up counts its own steps)."""
        self.cursor.policy_version += 1
        if sft and self.tc.mode == "rl":
            self.cursor.sft_step += 1
        else:
            self.cursor.step += 1
        keys = [] if sft else batch.group_keys
        self.cursor.note_trained(batch.batch_id, keys, keep=self.tc.checkpoint_every)
        if batch.groups:  # from the buffer: the dataset epochs of its prompts
            self.cursor.epoch = max(self.cursor.epoch, *(g.epoch for g in batch.groups))
        self._sync_status()  # GetStatus never shows a checkpoint of a step it does not show
        self._log_batch("step", batch)

    def _log_batch(self, event: str, batch: Batch) -> None:
        self.trained_log.write(batch.record(event, self.cursor.step, self.cursor.policy_version))

    # ------------------------------------------------------------------ checkpoints

    def _unsaved(self) -> bool:
        return self.checkpoints.unsaved(self.cursor)

    def _checkpoint_due(self, sft: bool) -> bool:
        every = self.tc.checkpoint_every
        # The warm-up's checkpoints are step-000000, step-000000.1, ... (`step` stays 0).
        done = self.cursor.sft_step if sft and self.tc.mode == "rl" else self.cursor.step
        return bool(every) and done % every == 0

    def _checkpoint_unsaved(self) -> None:
        """A checkpoint of the steps trained since the last one, if checkpoints are on (a
        graceful stop; `checkpoint_every: 0` turns off all but the job's final one)."""
        if self.tc.checkpoint_every and self._unsaved():
            self._checkpoint()

    def _checkpoint_final(self) -> None:
        """The job's end: its trained weights are saved (and exported) whatever
        `checkpoint_every` is, once: not again when the last step's checkpoint has them."""
        if self._unsaved():
            self._checkpoint()

    def _checkpoint_requested(self) -> None:
        """CheckpointNow. When the newest checkpoint holds the current step already (every
        rank decides alike) it is the answer: saving again would only write the same weights
        to a second folder (`step-NNNNNN.1`)."""
        if self.checkpoints.holds(self.cursor):
            self.control.checkpoint_request.clear()
            log.info("checkpoint.already_saved", path=self.status.saved[0])
            self.control.answered()
        else:
            self._checkpoint()

    def _checkpoint(self) -> None:
        """Save, answer a pending CheckpointNow with it, acknowledge what it holds."""
        # Cleared now, not at the end: a CheckpointNow arriving while this one is written is
        # answered by it (it holds the current step), and the request it left set finds this
        # step saved and writes nothing.
        self.control.checkpoint_request.clear()
        path = self.checkpoints.save(self.cursor, self.status.metrics)
        self.status.saved = (str(path), self.cursor.step)
        self.control.answered()
        self.delivery.commit_held()  # durable now: the batches it holds are acknowledged

    # ------------------------------------------------------------------ publish, eval, status

    def _publish(self) -> None:
        self.publisher.publish(self.cursor.policy_version)

    def _evaluate(self) -> None:
        """An eval round of the current weights, when the job has eval data. Collective."""
        if not self.config.data.eval:
            return
        if self.cursor.policy_version > 0:
            self.publisher.publish_current(self.cursor.policy_version)
        self.delivery.flush()
        result = self.evaluator.evaluate(self.cursor, self.status.saved[0])
        if result:
            self.status.metrics.update(result)
            round_ = self.cursor.eval_round - 1
            self.reporter.eval(
                result, round_, self.cursor.step, self.evaluator.last_groups, self._trained()
            )

    def _sync_status(self) -> None:
        self.status.step = self.cursor.step
        self.status.policy_version = self.cursor.policy_version
        self.status.epoch = self.cursor.epoch
        if self.cursor.metrics:
            self.status.metrics.update(self.cursor.metrics)

    def _record(self, metrics: dict[str, float], kind: str, batch: Batch) -> None:
        # The status took the step already (`_advance`, before the checkpoint).
        self.status.metrics.update(metrics)
        self.status.metrics["step"] = float(self.cursor.step)
        self.reporter.step(
            metrics, kind, self.cursor.step, self.cursor.policy_version, batch, self._trained()
        )

    def _trained(self) -> int:
        """Steps trained so far, an RL job's warm-up included: the trackers' x-axis."""
        return self.cursor.sft_step + self.cursor.step

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Load the model(s), build the DeepSpeed engines, connect, resume. Collective."""
        started = time.perf_counter()
        self.models.load_tokenizer(self.config, self.base)
        self.sft_file = SFTFile.load(self.config, self.base, self.models.tokenizer)
        self.models.load(self.config, self.dist)
        if self.dist.is_main:
            self._connect()
        self._resume()
        if self.dist.is_main and self.config.job.tracking:
            self.reporter.tracking = Tracking.open(
                self.config,
                self.base,
                self.checkpoints.root,
                resumed=bool(self.status.saved[0]),
                decode=self._decode,
                step=self._trained(),
                warm_up=warm_up_folder(),
            )
        self.trained_log.write(
            {
                "event": "start",
                "step": self.cursor.step,
                "policy_version": self.cursor.policy_version,
                "checkpoint": self.status.last_checkpoint,
            }
        )
        self.status.ready = True
        log.info(
            "trainer.ready",
            model=str(self.models.model_dir),
            zero_stage=self.tc.zero_stage,
            world_size=self.dist.world_size,
            dtype=str(train_dtype(self.config.model, self.dist.device)),
            step=self.cursor.step,
            seconds=round(time.perf_counter() - started, 2),
        )

    def _decode(self, ids: Iterable[int]) -> str:
        return str(self.models.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True))

    def _connect(self) -> None:
        """Rank 0: the buffer (unless the job reads only an SFT file) and weight-sync."""
        from kuberl.api.buffer.v1 import buffer_pb2_grpc
        from kuberl.common.channels import sync_channel

        if self.tc.mode != "sft" or self.tc.sft_data is None:
            self._channel = sync_channel(self.config.endpoints.buffer)
            self.delivery.buffer = buffer_pb2_grpc.BufferServiceStub(self._channel)
        self.publisher.connect()

    def _resume(self) -> None:
        """Continue from the newest checkpoint, under a version above any published since."""
        loaded = self.checkpoints.load_latest()
        if loaded is not None:
            path, self.cursor = loaded
            self.status.saved = (str(path), self.cursor.step)
            self._acknowledge_warm_up()
        # Versions published after the checkpoint (or by a trainer of this job that died before
        # its first one) belong to weights that are now lost: jump past them, so these weights
        # go out under a new, higher version (weight-sync and the buffer refuse lower ones).
        seen = 0
        if self.dist.is_main:
            seen = max(self.delivery.policy_version(), self.publisher.current_version())
        seen = int(broadcast_bytes(str(seen).encode(), self.dist).decode())
        if seen > self.cursor.policy_version:
            log.info("trainer.version_jump", checkpoint=self.cursor.policy_version, seen=seen)
            self.cursor.policy_version = seen + 1
        self._sync_status()
        if loaded is not None:
            log.info("trainer.resumed", path=str(loaded[0]), step=self.cursor.step)

    def _acknowledge_warm_up(self) -> None:
        """Resumed past a warm-up that read the buffer's SFT stream: its last batches may
        still be held, or issued and unacknowledged, and the SFT stream is never read again to
        hand them back. The checkpoint has every one of them, so they are acknowledged now."""
        tc = self.tc
        warmed = tc.mode == "rl" and tc.sft_steps and self.cursor.sft_step >= tc.sft_steps
        if warmed and tc.sft_data is None:
            sft_batches = [b for b in self.cursor.trained_batches if b.startswith("sft-")]
            self.delivery.acknowledge(sft_batches)
