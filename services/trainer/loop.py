"""The training loop: the trainer drives the job.

One RL step (every rank runs it; rank 0 alone talks to the buffer and weight-sync):

    GetBatch (rank 0, whole groups) -> broadcast to all ranks as protobuf bytes
    -> old logprobs recomputed by the trainer if configured (else the rollout's, with TIS/MIS),
       reference logprobs (KL) and critic values, each rank on its share, summed over ranks
    -> advantages (`kuberl.trainer.algorithms.compute_advantages`, the whole batch on every rank)
    -> ppo_epochs x mini_batches optimizer updates, each over token-budget micro-batches
    -> policy version + 1 -> checkpoint every `checkpoint_every` steps (and once at the job's
       end, whatever `checkpoint_every` is)
    -> buffer SetPolicyVersion -> publish the weights every `publish_every` steps (ZeRO-3
       parameters gathered bucket by bucket, streamed to weight-sync)
    -> the next GetBatch acknowledges this batch in the same call (`ack_batch_id`; a separate
       Ack when the job ends, stops or evaluates first); between checkpoints it *holds* it
       instead (`hold`), and the batches held since the last checkpoint are acknowledged right
       after the next one.

What a crash costs: the restarted trainer resumes from its latest checkpoint. A batch is
acknowledged only once a checkpoint holds its step (`ack_after_checkpoint`, the default), and
that checkpoint names it (`Cursor.trained_batches`). Until then the buffer holds it: its groups
stay in Redis (outside the backpressure window) and are not re-delivered to this trainer, and the
restarted trainer's first GetBatch of each kind (`reopen_held`) gets every held batch back with
its id. So after a crash a batch the checkpoint names is only acknowledged, one trained after the
checkpoint is trained again, and one never trained comes back after its ack timeout: every group
is in the final weights exactly once, for any `checkpoint_every` > 0. With `ack_after_checkpoint:
false` batches between checkpoints are acknowledged right after their step, and a crash loses up
to `checkpoint_every - 1` steps of groups from the weights.

With `KUBERL_TRAINED_JSONL` set, rank 0 appends one row per trained batch (the (prompt, epoch)
of each group, its replica and policy versions) and one per start, so a run's accounting
(`kuberl run --chaos`) can tell which steps the final weights descend from.

`sft` mode trains on a JSONL file (or the buffer's SFT stream) with the loss on the response;
`eval` mode, and `eval_every` in rl mode, queue an eval round in the buffer
(StartEval), read the EVAL groups that rollout replicas put back and report accuracy per dataset.

Rank 0 drives control flow: at each decision point it broadcasts one message (a batch, "stop",
"checkpoint now", "data exhausted") so every rank makes the same collective calls.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from kuberl.common import metrics as prom
from kuberl.common.config import JobConfig
from kuberl.common.logs import get_logger
from kuberl.common.trajectory import Group, TrajectoryError
from kuberl.trainer import algorithms as algo
from kuberl.trainer import checkpoint as ckpt
from kuberl.trainer.batching import MicroBatch, Sample, collate, micro_batches, shard
from kuberl.trainer.distributed import (
    DistInfo,
    all_reduce_max,
    barrier,
    broadcast_bytes,
    gather_json,
)
from kuberl.trainer.engine import (
    FrozenModel,
    TrainEngine,
    ValueModel,
    build_policy,
    enable_activation_checkpointing,
    full_numel,
    load_causal_lm,
    run_forward,
    run_micro_batches,
    split_outputs,
    train_dtype,
)
from kuberl.trainer.sft import (
    epoch_batches,
    read_pairs,
    samples_from_groups,
    sft_loss_fn,
    tokenize_pairs,
)

log = get_logger(__name__)

METRICS_JSONL_ENV = "KUBERL_METRICS_JSONL"
TRAINED_JSONL_ENV = "KUBERL_TRAINED_JSONL"

# Peak dense bf16 FLOP/s per GPU for MFU, by a substring of the device name.
#: Dense bf16 peaks by device name, the more specific names first (an "H100 PCIe" is not an SXM).
PEAK_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
}


def head_temperature(config: JobConfig) -> float:
    """The temperature the policy head divides logits by: the rollout's, as the engine's
    logprobs are (an RL job's SFT warm-up so fits what its engines will sample), except in
    `mode: sft`, which fits the model itself (its export is sampled at any temperature): 1."""
    if config.trainer.mode == "sft":
        return 1.0
    return config.rollout.sampling.temperature or 1.0


def step_flops(
    *,
    body_params: int,
    head_params: int,
    tokens: int,
    response_tokens: int,
    training_passes: int,
    forward_passes: int,
    reference: bool = False,
    critic_body_params: int = 0,
    critic_training_passes: int = 0,
) -> float:
    """Model FLOPs of one trainer step (2 per parameter and token forward, 6 forward and
    backward), counting what ran: the policy's body on every token and its vocabulary head at
    the response positions only, `training_passes` forward-and-backward passes and
    `forward_passes` no-grad ones (recomputed old logprobs), the reference's forward, and the
    critic's value forward and its training passes. Recomputation (activation checkpointing,
    the chunked head's backward) is not credited; nor is attention's sequence-squared term."""
    forward = 2.0 * (body_params * tokens + head_params * response_tokens)
    flops = forward * (3 * training_passes + forward_passes + int(reference))
    flops += 2.0 * critic_body_params * tokens * (1 + 3 * critic_training_passes)
    return flops


STEP_SECONDS = prom.histogram("kuberl_trainer_step_seconds", "Wall time of one trainer step")
TOKENS = prom.counter("kuberl_trainer_tokens_total", "Tokens trained on (prompt + response)")
STEPS = prom.counter("kuberl_trainer_steps_total", "Trainer steps completed", ["mode"])
POLICY_VERSION = prom.gauge("kuberl_trainer_policy_version", "Policy version of the trainer")
STEP_GAUGE = prom.gauge("kuberl_trainer_step", "Last completed trainer step")
LOSS = prom.gauge("kuberl_trainer_loss", "Loss terms of the last step", ["term"])
GRAD_NORM = prom.gauge("kuberl_trainer_grad_norm", "Gradient norm before clipping (last step)")
KL = prom.gauge("kuberl_trainer_kl", "KL to the reference policy (last step)")
ENTROPY = prom.gauge("kuberl_trainer_entropy", "Mean token entropy of the policy (last step)")
CLIP_FRACTION = prom.gauge("kuberl_trainer_clip_fraction", "PPO clipped token fraction")
MISMATCH = prom.gauge(
    "kuberl_trainer_mismatch", "Train-inference mismatch figures (TIS/MIS)", ["figure"]
)
REWARD = prom.gauge("kuberl_trainer_reward_mean", "Mean reward of the last batch")
TOKENS_PER_SECOND = prom.gauge("kuberl_trainer_tokens_per_second", "Throughput of the last step")
MFU = prom.gauge("kuberl_trainer_mfu_ratio", "Model FLOPs utilisation of the last step (GPU)")
EVAL_ACCURACY = prom.gauge("kuberl_trainer_eval_accuracy", "Eval accuracy", ["dataset"])
PUBLISH_SECONDS = prom.histogram("kuberl_trainer_publish_seconds", "Weight publish wall time")
PUBLISH_FAILURES = prom.counter(
    "kuberl_trainer_publish_failures_total", "Weight publishes that failed", ["reason"]
)
CHECKPOINT_SECONDS = prom.histogram("kuberl_trainer_checkpoint_seconds", "Checkpoint wall time")
BATCHES = prom.counter("kuberl_trainer_batches_total", "Batches received", ["kind"])
REJECTED = prom.counter(
    "kuberl_trainer_rejected_groups_total", "Groups the trainer could not train on", ["reason"]
)
ALREADY_TRAINED = prom.counter(
    "kuberl_trainer_already_trained_batches_total",
    "Re-delivered batches the checkpoint had already trained on: acknowledged, not trained",
)


class TrainerError(RuntimeError):
    """The job cannot go on (bad data for the configured algorithm, missing files)."""


@dataclass
class Status:
    """What GetStatus reports; written by the training thread, read by the server."""

    mode: str = "rl"
    step: int = 0
    total_steps: int = 0
    policy_version: int = 0
    #: The newest dataset epoch of the buffer's groups trained so far (their keys are
    #: `<prompt>@<epoch>`); in sft mode from `sft_data`, the epoch of that file being read.
    epoch: int = 0
    world_size: int = 1
    # (path, step) of the newest checkpoint in one assignment: a reader never pairs one
    # checkpoint's path with a step the trainer reached later (CheckpointNow answers with it).
    saved: tuple[str, int] = ("", 0)
    #: Checkpoint requests answered: by a checkpoint written, or by the newest one when it
    #: holds the current step already. Counted after `saved` is set (CheckpointNow waits on it).
    checkpoints_answered: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    finished: bool = False
    ready: bool = False
    error: str = ""

    @property
    def last_checkpoint(self) -> str:
        return self.saved[0]


# Control messages broadcast by rank 0 (first byte), followed by a payload.
# MSG_WAIT ("nothing yet") goes out at least every minute while rank 0 waits for rollout, so the
# other ranks never sit in one collective long enough for a NCCL/gloo timeout.
MSG_BATCH, MSG_STOP, MSG_CHECKPOINT, MSG_EXHAUSTED = b"B", b"S", b"C", b"X"
MSG_WAIT = b"W"
# MSG_PUBLISH ("publish the current weights again") goes out while rank 0 waits for rollout after
# a publish failed (weight-sync restarting): without it, replicas left on old weights produce only
# groups too stale to train on, and the trainer, which publishes only after a step, waits forever.
MSG_PUBLISH = b"P"
PUBLISH_RETRY_SECONDS = 2.0
# Publishes refused as conflicts, though weight-sync does not hold the version, retried in a row.
PUBLISH_CONFLICT_RETRIES = 3
# What acknowledging the held batches after a checkpoint may take, per try of each batch (one
# after a checkpoint, while the other ranks wait; five at the job's end).
COMMIT_SECONDS = 20.0


class Trainer:
    """The whole trainer of one process (every rank builds one)."""

    def __init__(self, config: JobConfig, dist_info: DistInfo, base_dir: Path | None = None):
        self.config = config
        self.tc = config.trainer
        self.dist = dist_info
        self.base = base_dir or Path.cwd()
        self.status = Status(
            mode=self.tc.mode, total_steps=self.tc.total_steps, world_size=dist_info.world_size
        )
        self.cursor = ckpt.Cursor()
        self.stop_event = threading.Event()
        self.checkpoint_request = threading.Event()
        self.checkpoint_done = threading.Condition()
        self.engine: TrainEngine | None = None
        self.critic: TrainEngine | None = None
        self.reference: FrozenModel | None = None
        self.buffer: Any = None
        self.publisher: Any = None
        self.tokenizer: Any = None
        self.model_dir = Path()
        self.pad_id = 0
        self.tied = False
        self._metrics_file = os.environ.get(METRICS_JSONL_ENV)
        self._trained_file = os.environ.get(TRAINED_JSONL_ENV)
        self._sft_iter: Iterator[tuple[int, list[Sample]]] | None = None
        #: (sft_step, step) of the weights in the last checkpoint written or loaded.
        self._checkpointed_at: tuple[int, int] | None = None
        #: The last trained batch, acknowledged (or held) by the next GetBatch (rank 0).
        self._unacked = ""
        self._unacked_hold = False
        #: Batches trained since the last checkpoint, held in the buffer until it (rank 0).
        self._uncommitted: list[str] = []
        #: Stream kinds whose held batches this trainer has asked back (its first GetBatch).
        self._reopened: set[int] = set()
        self._sft_samples: list[Sample] = []
        self.stopped = False
        self._publish_failed_at: float | None = None  # rank 0: the last publish failed then
        self._conflicts_retried = 0  # rank 0: refused publishes retried since the last success
        #: The policy version last handed to `_publish` (every rank; failures are retried apart).
        self._published_version = -1
        self.vocab_size = 0

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Load the model(s), build the DeepSpeed engines, connect, resume. Collective."""
        from kuberl.common.modelbuild import load_tokenizer, resolve_model

        started = time.perf_counter()
        self.model_dir = resolve_model(self.config, base_dir=self.base)
        self.tokenizer = load_tokenizer(self.model_dir)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id or 0)
        if self.tc.sft_data and (self.tc.mode == "sft" or self.tc.sft_steps):
            path = Path(self.tc.sft_data)  # read now: a bad file fails the start, not step 1
            path = path if path.is_absolute() else self.base / path
            self._sft_samples = tokenize_pairs(read_pairs(path), self.tokenizer)
        dtype = train_dtype(self.config.model, self.dist.device)
        temperature = head_temperature(self.config)
        hf = load_causal_lm(self.model_dir, dtype)
        self.tied = bool(getattr(hf.config, "tie_word_embeddings", False))
        self.vocab_size = int(hf.get_input_embeddings().weight.shape[0])
        enable_activation_checkpointing(hf, self.tc.gradient_checkpointing)
        self.engine = TrainEngine(build_policy(hf, self.tc, temperature), self.tc, self.dist, dtype)
        alg = self.tc.algorithm
        if alg.kl.coef > 0 and self.tc.mode == "rl":
            # The policy's own build (head settings, compiled layers), frozen.
            ref = build_policy(load_causal_lm(self.model_dir, dtype), self.tc, temperature)
            self.reference = FrozenModel(
                ref, self.tc, self.dist, dtype, offload=alg.kl.offload_reference
            )
        if algo.resolve_algorithm(alg).needs_critic and self.tc.mode == "rl":
            backbone = load_causal_lm(self.model_dir, dtype).get_decoder()
            critic = ValueModel(backbone, int(hf.config.hidden_size))
            self.critic = TrainEngine(critic, self.tc, self.dist, dtype)
        if self.dist.is_main:
            self._connect()
        self._resume()
        self._write_trained(
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
            model=str(self.model_dir),
            zero_stage=self.tc.zero_stage,
            world_size=self.dist.world_size,
            dtype=str(dtype),
            step=self.cursor.step,
            seconds=round(time.perf_counter() - started, 2),
        )

    def _connect(self) -> None:
        from kuberl.api.buffer.v1 import buffer_pb2_grpc
        from kuberl.common.channels import sync_channel

        needs_buffer = self.tc.mode != "sft" or self.tc.sft_data is None
        if needs_buffer:
            self._channel = sync_channel(self.config.endpoints.buffer)
            self.buffer = buffer_pb2_grpc.BufferServiceStub(self._channel)
        if self.tc.publish_weights and self.tc.mode != "eval":
            from kuberl.common.weights import WeightPublisher

            self.publisher = WeightPublisher(
                self.config.endpoints.weight_sync, **publisher_options(self.dist.device)
            )

    @property
    def checkpoint_root(self) -> Path:
        p = Path(self.tc.checkpoint_dir)
        return p if p.is_absolute() else self.base / p

    def _resume(self) -> None:
        path = ckpt.latest(self.checkpoint_root) if self.tc.resume else None
        if path is not None:
            assert self.engine is not None
            if self.tc.mode != "eval":  # eval mode needs only the cursor: engines hold weights
                self.engine.load(path / "policy", path.name)
                if self.critic is not None:
                    self.critic.load(path / "critic", path.name)
            self.cursor = ckpt.read_cursor(path, self.dist.rank)
            self.status.saved = (str(path), self.cursor.step)
            self._checkpointed_at = self._position()  # its weights are the checkpoint's
            self._acknowledge_warm_up()
        # Versions published after the checkpoint (or by a trainer of this job that died before
        # its first one) belong to weights that are now lost: jump past them, so these weights
        # go out under a new, higher version (weight-sync and the buffer refuse lower ones).
        seen = self._versions_elsewhere() if self.dist.is_main else 0
        seen = int(broadcast_bytes(str(seen).encode(), self.dist).decode())
        if seen > self.cursor.policy_version:
            log.info("trainer.version_jump", checkpoint=self.cursor.policy_version, seen=seen)
            self.cursor.policy_version = seen + 1
        self._sync_status()
        if path is not None:
            log.info("trainer.resumed", path=str(path), step=self.cursor.step)

    def _acknowledge_warm_up(self) -> None:
        """Resumed past a warm-up that read the buffer's SFT stream (rank 0): its last batches
        may still be held, or issued and unacknowledged (a crash between the checkpoint that
        ended the warm-up and their Acks), and the SFT stream is never read again to hand them
        back. The checkpoint has every one of them, so the SFT batches it names are
        acknowledged now (idempotent: one acknowledged before, or forgotten, changes nothing)."""
        tc = self.tc
        warmed = tc.mode == "rl" and tc.sft_steps and self.cursor.sft_step >= tc.sft_steps
        if not (warmed and tc.sft_data is None and self.dist.is_main):
            return
        for batch_id in self.cursor.trained_batches:
            if batch_id.startswith("sft-"):
                self._ack(batch_id, attempts=1, timeout=5.0)

    def _held_elsewhere(self, version: int) -> bool:
        """Weight-sync holds `version` or a newer one: a refused publish is a real conflict.
        Otherwise the refusal may come from a weight-sync restarted between Publish and
        CommitPublish, and the publish is retried (at most PUBLISH_CONFLICT_RETRIES times)."""
        try:
            return int(self.publisher.current_version()) >= version
        except Exception as exc:
            log.warning("weight_sync.unreachable", error=str(exc)[:300])
            return False

    def _versions_elsewhere(self) -> int:
        """The highest policy version the buffer or weight-sync knows (0 if unreachable)."""
        found = 0
        if self.buffer is not None:
            from kuberl.api.buffer.v1 import buffer_pb2

            try:
                stats = self.buffer.GetStats(buffer_pb2.GetStatsRequest(), timeout=10)
                found = max(found, int(stats.policy_version))
            except Exception as exc:
                log.warning("buffer.unreachable_at_resume", error=str(exc)[:300])
        if self.publisher is not None:
            try:
                found = max(found, int(self.publisher.current_version()))
            except Exception as exc:
                log.warning("weight_sync.unreachable_at_resume", error=str(exc)[:300])
        return found

    # ------------------------------------------------------------------ the job

    def run(self) -> None:
        """Train until total_steps (or the data ends, or stop). Collective."""
        try:
            self._run()
            self._flush_ack()
            if self.dist.is_main and self._checkpointed_at == self._position():
                self._commit_held(attempts=5)  # what a checkpoint could not acknowledge then
        except BaseException as exc:
            # Before `finished`: a CheckpointNow waiting on both must see the failure.
            self.status.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.status.finished = True
            with self.checkpoint_done:
                self.checkpoint_done.notify_all()

    def _run(self) -> None:
        tc = self.tc
        if tc.mode == "eval":
            self._evaluate()
            return
        if self.cursor.policy_version > 0:
            self._publish()  # engines that started from the base weights catch up
        if tc.mode == "rl" and self.cursor.sft_step < tc.sft_steps:
            while self.cursor.sft_step < tc.sft_steps:
                if not self._one_step(sft=True):
                    if not self.stopped:
                        self._checkpoint_final()  # the warm-up's data ran out: the job ends
                    return
        if tc.mode == "rl" and self.cursor.step == 0 and self.cursor.eval_round == 0:
            self._evaluate()
        while self.cursor.step < tc.total_steps:
            before = self.cursor.step
            if not self._one_step(sft=tc.mode == "sft"):
                break
            stepped = self.cursor.step != before  # not a checkpoint or an acknowledgement only
            if (
                tc.mode == "rl"
                and tc.eval_every
                and stepped
                and self.cursor.step % tc.eval_every == 0
            ):
                self._evaluate()
        if self.stopped:
            log.info("trainer.stopped", step=self.cursor.step)
            return
        if tc.mode == "rl" and (not tc.eval_every or self.cursor.step % tc.eval_every):
            self._evaluate()  # the final weights' round, unless the last step just had one
        if self.cursor.policy_version > 0:
            self._publish_current()  # the engines end on the final weights
        self._checkpoint_final()  # the last steps, also when the data ran out first
        log.info("trainer.finished", step=self.cursor.step, version=self.cursor.policy_version)

    def _one_step(self, sft: bool) -> bool:
        """One step; False when the job must end (stop requested or data exhausted)."""
        msg, batch = self._next_batch(sft)
        if msg == MSG_STOP:
            self.stopped = True
            self._checkpoint_unsaved()  # a graceful stop (SIGTERM, preemption) keeps its progress
            return False
        if msg == MSG_EXHAUSTED:
            log.info("trainer.data_exhausted", step=self.cursor.step)
            return False
        if msg == MSG_CHECKPOINT:
            if self._checkpointed_at == self._position():
                self._answer_saved()  # the request came while or just after this step's save
            else:
                self._checkpoint()
            return True
        batch_id = batch.get("batch_id", "")
        if batch_id and batch_id in self.cursor.trained_batches:
            # Trained and checkpointed, then the Ack was lost (a crash in between): the weights
            # already hold this batch, so it is only acknowledged. One trained since the last
            # checkpoint (re-delivered on its ack timeout before this trainer held it) is held.
            ALREADY_TRAINED.inc()
            log.warning("batch.already_trained", batch_id=batch_id)
            self._write_trained({"event": "already_trained", "batch_id": batch_id})
            self._ack(batch_id, hold=batch_id in self._uncommitted)
            return True
        if not batch["samples"]:  # every group was unusable: acknowledge, count, go on
            self._write_trained(self._trained_row("rejected", batch))
            # Held like a trained batch: groups left out as trained since the last checkpoint
            # must come back (and be trained) if those steps die with this process.
            self._ack(batch_id, hold=self._hold(batch_id))
            return True
        started = time.perf_counter()
        metrics = self._sft_step(batch) if sft else self._rl_step(batch)
        self.cursor.policy_version += 1
        if sft and self.tc.mode == "rl":
            self.cursor.sft_step += 1
        else:
            self.cursor.step += 1
        keys = [] if sft else [f"{g.prompt_id}@{g.epoch}" for g in batch["groups"]]
        self.cursor.note_trained(batch_id, keys, keep=self.tc.checkpoint_every)
        if batch.get("groups"):  # from the buffer: the dataset epochs of its prompts
            self.cursor.epoch = max(self.cursor.epoch, *(g.epoch for g in batch["groups"]))
        self._sync_status()  # GetStatus never shows a checkpoint of a step it does not show
        self._write_trained(self._trained_row("step", batch))
        metrics.update(self._speed(batch, sft, time.perf_counter() - started))
        warmup = sft and self.tc.mode == "rl"
        every = self.tc.checkpoint_every
        # The SFT warm-up counts its own steps (`step` stays 0: its checkpoints are step-000000,
        # step-000000.1, ...); its batches may come from the buffer and are acknowledged too.
        if every and (self.cursor.sft_step if warmup else self.cursor.step) % every == 0:
            self._checkpoint()  # before the Ack: see the module docstring
        if self.dist.is_main:
            self._flush_ack()  # a step that came from elsewhere (SFT file) left none behind
            # Acknowledged by the next GetBatch; held there until a checkpoint has its step.
            self._unacked, self._unacked_hold = batch_id, self._hold(batch_id)
        self._set_buffer_version()
        if self.cursor.policy_version % self.tc.publish_every == 0:
            self._publish()
        metrics["step_seconds"] = time.perf_counter() - started
        self._record(metrics, "sft" if sft else "rl")
        return True

    def _trained_row(self, event: str, batch: dict[str, Any]) -> dict[str, Any]:
        """The record of one batch: each group's (prompt, epoch), replica and versions."""
        groups = []
        for g in batch.get("groups", []):
            meta = g.trajectories[0].metadata if g.trajectories else {}
            groups.append(
                {
                    "key": f"{g.prompt_id}@{g.epoch}",
                    "replica": meta.get("replica", ""),
                    "version_start": min(
                        (t.policy_version_start for t in g.trajectories), default=0
                    ),
                    "version_end": max((t.policy_version_end for t in g.trajectories), default=0),
                    "finished": max((t.finished_unix for t in g.trajectories), default=0.0),
                }
            )
        return {
            "event": event,
            "step": self.cursor.step,
            "policy_version": self.cursor.policy_version,
            "batch_id": batch.get("batch_id", ""),
            "redelivered": bool(batch.get("redelivered")),
            "groups": groups,
            "rejected": batch.get("rejected_keys", []),
        }

    def _write_trained(self, row: dict[str, Any]) -> None:
        if not self._trained_file or not self.dist.is_main:
            return
        line = json.dumps({"time": time.time(), **row}) + "\n"
        with open(self._trained_file, "ab+") as f:
            # A line torn by a SIGKILL mid-write is ended first: appended to it, this row (a
            # restart's `start`) would be unreadable too, and the accounting would miss it.
            end = f.seek(0, os.SEEK_END)
            if end:
                f.seek(end - 1)
                if f.read(1) != b"\n":
                    line = "\n" + line
            f.write(line.encode())  # appended wherever the file position is ("a" mode)
            f.flush()
            os.fsync(f.fileno())

    def _flush_ack(self) -> None:
        """Acknowledge (or hold) the last trained batch now (rank 0) instead of with the next
        GetBatch."""
        batch_id, self._unacked = self._unacked, ""
        self._ack(batch_id, hold=self._unacked_hold)

    def _position(self) -> tuple[int, int]:
        return self.cursor.sft_step, self.cursor.step

    def _unsaved(self) -> bool:
        """Steps were trained since the last checkpoint (or, with none, at all)."""
        return self._checkpointed_at != self._position() and any(self._position())

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

    def _hold(self, batch_id: str) -> bool:
        """Whether a batch trained now is held rather than acknowledged (rank 0): no checkpoint
        has its step yet. Noted for `_commit_held`."""
        hold = bool(
            batch_id
            and self.dist.is_main
            and self.tc.ack_after_checkpoint
            and self.tc.checkpoint_every
            and self._unsaved()
        )
        if hold and batch_id not in self._uncommitted:
            self._uncommitted.append(batch_id)
        return hold

    def _ack(
        self, batch_id: str, hold: bool = False, attempts: int = 5, timeout: float = 30.0
    ) -> bool:
        """Acknowledge (or hold) a trained batch (rank 0); False when it could not be. Such a
        batch is re-delivered by the buffer later: recognised by its id, it is acknowledged
        (held) then; that is logged."""
        if not batch_id or not self.dist.is_main:
            return True
        from kuberl.api.buffer.v1 import buffer_pb2

        for attempt in range(attempts):
            try:
                request = buffer_pb2.AckRequest(batch_id=batch_id, hold=hold)
                self.buffer.Ack(request, timeout=min(timeout, 30.0))
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

    def _commit_held(self, attempts: int = 1) -> None:
        """After a checkpoint (rank 0): acknowledge the batches held since the previous one (a
        batch that could not be acknowledged is tried again after the next checkpoint and at
        the job's end), and the last trained batch, still to be sent, is acknowledged rather
        than held. Within COMMIT_SECONDS: rank 0 must not keep the other ranks waiting in their
        next collective through a buffer outage."""
        self._unacked_hold = False
        deadline = time.monotonic() + COMMIT_SECONDS * attempts
        left = []
        for batch_id in (b for b in self._uncommitted if b != self._unacked):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._ack(batch_id, attempts=attempts, timeout=remaining):
                left.append(batch_id)
        if left:
            log.warning("buffer.commit_deferred", batches=len(left))
        self._uncommitted = left

    def _usable(
        self,
        groups: list[Group],
        same_size: bool = True,
        rejected: list[dict[str, str]] | None = None,
        trained: set[str] | None = None,
    ) -> list[Group]:
        """Groups the model can train on; the others are counted and left out. Token ids
        must be inside the vocabulary, prompts non-empty, arrays of one length and finite, and
        (RL, `same_size`) a batch's groups of one size; rejection sampling's SFT groups keep any
        number of samples. A group whose key is in `trained` was trained on already."""
        sizes = [len(g.trajectories) for g in groups]
        common = max(set(sizes), key=sizes.count) if sizes else 0
        kept = []
        for g in groups:
            reason = None
            if trained is not None and f"{g.prompt_id}@{g.epoch}" in trained:
                reason = "already_trained"
            elif same_size and len(g.trajectories) != common:
                reason = "group_size"
            for t in g.trajectories:
                ids = np.concatenate([t.prompt_token_ids, t.response_token_ids])
                try:
                    t.validate()
                except TrajectoryError:
                    reason = "invalid_trajectory"
                    continue
                if len(t.prompt_token_ids) == 0:
                    reason = "empty_prompt"
                elif ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
                    reason = "token_out_of_vocabulary"
            if reason is None:
                kept.append(g)
            else:
                REJECTED.labels(reason).inc()
                log.warning("group.rejected", group_id=g.group_id, reason=reason)
                if rejected is not None:
                    rejected.append({"key": f"{g.prompt_id}@{g.epoch}", "reason": reason})
        return kept

    # ------------------------------------------------------------------ batches

    def _next_batch(self, sft: bool) -> tuple[bytes, dict[str, Any]]:
        """Rank 0 gets the next batch (or a control message) and every rank receives it."""
        from_file = sft and self.tc.sft_data is not None
        if from_file:
            self._share_stop()
            msg = self._control_only()
            if msg != MSG_BATCH:
                return msg, {}
            return MSG_BATCH, self._file_batch()
        while True:  # short rounds, so no rank sits in one collective for long
            self._share_stop()
            payload = self._fetch_batch(sft) if self.dist.is_main else None
            data = broadcast_bytes(payload, self.dist)
            tag, body = data[:1], data[1:]
            if tag == MSG_PUBLISH:
                self._publish()
                continue
            if tag != MSG_WAIT:
                break
        if tag != MSG_BATCH:
            return tag, {}
        from kuberl.api.buffer.v1 import buffer_pb2

        resp = buffer_pb2.GetBatchResponse.FromString(body)
        rejected_keys: list[dict[str, str]] = []
        groups = self._usable(
            [Group.from_proto(g) for g in resp.groups],
            same_size=not sft,
            rejected=rejected_keys,
            # (A re-delivered batch of a known id is acknowledged untrained by `_one_step`.)
            trained=None
            if sft or resp.batch_id in self.cursor.trained_batches
            else set(self.cursor.trained_groups),
        )
        samples = samples_from_groups(groups)
        return MSG_BATCH, {
            "rejected": len(resp.groups) - len(groups),
            "rejected_keys": rejected_keys,
            "batch_id": resp.batch_id,
            "groups": groups,
            "samples": samples,
            "redelivered": resp.redelivered,
            "dropped": dict(resp.dropped),
            "tokens": sum(s.length for s in samples),
        }

    def _share_stop(self) -> None:
        """A SIGTERM that reached any rank stops the job (collective): rank 0 decides, and a
        worker rank's own stop (its pod evicted) was ignored until torchrun killed it, the job
        then failing without its last checkpoint."""
        if all_reduce_max(int(self.stop_event.is_set()), self.dist):
            self.stop_event.set()

    def _control_only(self) -> bytes:
        tag = MSG_BATCH
        if self.dist.is_main:
            if self.stop_event.is_set():
                tag = MSG_STOP
            elif self.checkpoint_request.is_set():
                tag = MSG_CHECKPOINT
        return broadcast_bytes(tag, self.dist)[:1]

    def _file_batch(self) -> dict[str, Any]:
        if self._sft_iter is None:
            samples = self._sft_samples
            done = self.cursor.sft_step if self.tc.mode == "rl" else self.cursor.step
            per_epoch = max(1, len(samples) // self.tc.sft_batch_size)
            self._sft_iter = epoch_batches(
                samples, self.tc.sft_batch_size, self.config.job.seed, done // per_epoch
            )
            for _ in range(done % per_epoch):  # skip what the checkpoint already saw
                next(self._sft_iter)
        epoch, samples = next(self._sft_iter)
        if self.tc.mode == "sft":  # an RL job's epoch is its RL data's, not its warm-up's
            self.cursor.epoch = epoch
        return {"samples": samples, "tokens": sum(s.length for s in samples)}

    def _fetch_batch(self, sft: bool) -> bytes:
        from kuberl.api.buffer.v1 import buffer_pb2
        from kuberl.api.common.v1 import trajectory_pb2

        kind = trajectory_pb2.STREAM_KIND_SFT if sft else trajectory_pb2.STREAM_KIND_TRAIN
        want = self.tc.groups_per_step
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            failed = self._publish_failed_at
            if failed is not None and time.monotonic() - failed >= PUBLISH_RETRY_SECONDS:
                return MSG_PUBLISH
            if self.stop_event.is_set():
                return MSG_STOP
            if self.checkpoint_request.is_set():
                return MSG_CHECKPOINT
            try:
                raw = self.buffer.GetBatch.with_call(
                    buffer_pb2.GetBatchRequest(
                        num_groups=want,
                        max_staleness=self.tc.max_staleness,
                        current_version=self.cursor.policy_version,
                        consumer="trainer",
                        wait_seconds=self.tc.batch_wait_seconds,
                        kind=kind,
                        ack_batch_id=self._unacked,
                        hold=self._unacked_hold,
                        reopen_held=kind not in self._reopened,
                    ),
                    timeout=self.tc.batch_wait_seconds + 30,
                )[0]
                self._unacked = ""
                self._reopened.add(kind)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND and self._unacked:
                    # The buffer does not know the batch (its Redis lost it): nothing to ack.
                    log.error("buffer.ack_unknown", batch_id=self._unacked, error=exc.details())
                    self._unacked = ""
                    continue
                log.warning("buffer.get_batch_failed", error=str(exc)[:300])
                self.stop_event.wait(1.0)
                continue
            except Exception as exc:  # buffer restarting: wait and retry, never lose the step
                log.warning("buffer.get_batch_failed", error=str(exc)[:300])
                self.stop_event.wait(1.0)
                continue
            if raw.groups:
                BATCHES.labels("redelivered" if raw.redelivered else "new").inc()
                if raw.redelivered:
                    log.info("batch.redelivered", batch_id=raw.batch_id)
                return MSG_BATCH + raw.SerializeToString()
            if raw.exhausted:
                return MSG_EXHAUSTED
        return MSG_WAIT

    # ------------------------------------------------------------------ RL

    def _rl_step(self, batch: dict[str, Any]) -> dict[str, float]:
        assert self.engine is not None
        alg = self.tc.algorithm
        samples: list[Sample] = batch["samples"]
        groups: list[Group] = batch["groups"]
        group_size = len(groups[0].trajectories)  # `_usable` kept groups of one size
        for s, g_traj in zip(samples, [t for g in groups for t in g.trajectories], strict=True):
            s.arrays["rollout_logprobs"] = np.asarray(g_traj.rollout_logprobs, dtype=np.float32)

        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)  # [B]
        mask = _response_tensor(samples, None)  # [B, R]
        rollout_lp = _response_tensor(samples, "rollout_logprobs")  # [B, R]

        # Per-token figures from the trainer's own models, each rank on its share.
        old_lp = ref_lp = values = None
        if alg.recompute_old_logprobs:
            old_lp = self._forward_all(samples, lambda o: split_outputs(o)[0], self.engine.forward)
        if self.reference is not None:
            with self.reference.resident():
                ref_lp = self._forward_all(
                    samples, lambda o: split_outputs(o)[0], self.reference.forward
                )
        if self.critic is not None:
            values = self._forward_all(samples, lambda o: o, self.critic.forward)
        sampling_lp = old_lp if old_lp is not None else rollout_lp
        advantages, returns = algo.compute_advantages(
            alg,
            rewards,
            mask,
            group_size,
            values=values,
            old_logprobs=sampling_lp if ref_lp is not None else None,
            ref_logprobs=ref_lp,
        )
        named = {"advantages": advantages, "returns": returns}
        if old_lp is not None:
            named["old_logprobs"] = old_lp
        if ref_lp is not None:
            named["ref_logprobs"] = ref_lp
        if values is not None:
            named["values"] = values
        for i, s in enumerate(samples):
            n = s.response_length
            for key, t in named.items():
                s.arrays[key] = t[i, :n].numpy()

        updates = alg.ppo_epochs * alg.mini_batches
        records: list[dict[str, float]] = []
        for epoch in range(alg.ppo_epochs):
            order = np.random.default_rng([self.config.job.seed, self.cursor.step, epoch])
            idx = order.permutation(len(groups)) if updates > 1 else np.arange(len(groups))
            for part in np.array_split(idx, alg.mini_batches):
                rows = [s for g in part for s in samples[g * group_size : (g + 1) * group_size]]
                if not rows:
                    continue
                records.append(self._policy_update(rows, updates))
                if self.critic is not None:
                    records[-1].update(self._critic_update(rows))
        metrics = _mean_records(records)
        metrics.update(_reward_metrics(samples, self.tc.eval_correct_threshold))
        metrics["batch/groups"] = float(len(groups))
        metrics["batch/rejected_groups"] = float(batch.get("rejected", 0))
        metrics["batch/redelivered"] = float(bool(batch.get("redelivered")))
        for reason, n in batch.get("dropped", {}).items():
            metrics[f"batch/dropped/{reason}"] = float(n)
        versions = [t.policy_version_start for g in groups for t in g.trajectories]
        metrics["batch/staleness_max"] = float(self.cursor.policy_version - min(versions))
        return metrics

    def _forward_all(
        self, samples: list[Sample], pick: Callable[[Any], torch.Tensor], forward: Any
    ) -> torch.Tensor:
        """A per-token model output for every sample, response-aligned [B, R]: each rank
        computes its share, an all-reduce (sum over disjoint rows) gives everyone all rows."""
        mine = shard(samples, self.dist.rank, self.dist.world_size)
        mbs = [collate(g, self.pad_id, self.dist.device) for g in self._micro(mine)]
        outs = run_forward(forward, mbs, self.pad_id, self.dist)
        full = torch.zeros(len(samples), max([s.response_length for s in samples] + [1]))
        for mb, out in zip(mbs, outs, strict=True):
            per_resp = pick(out).float().cpu()  # [b, R_mb]
            for row, (i, n) in enumerate(zip(mb.indices, mb.response_lengths, strict=True)):
                full[i, :n] = per_resp[row, :n]
        if self.dist.world_size > 1:
            import torch.distributed as dist

            dev = self.dist.device if self.dist.device.type == "cuda" else torch.device("cpu")
            reduced = full.to(dev)
            dist.all_reduce(reduced)
            full = reduced.cpu()
        return full

    def _micro(self, samples: Sequence[Sample]) -> list[list[Sample]]:
        return micro_batches(samples, self.tc.micro_batch_tokens)

    def _policy_update(self, rows: list[Sample], updates: int) -> dict[str, float]:
        assert self.engine is not None
        alg = self.tc.algorithm
        names = ["advantages", "rollout_logprobs"]
        if "old_logprobs" in rows[0].arrays:
            names.append("old_logprobs")
        if "ref_logprobs" in rows[0].arrays:
            names.append("ref_logprobs")
        global_count, cfg = _global_count(alg, rows)
        ws = self.dist.world_size
        use_rollout_as_old = "old_logprobs" not in names and updates > 1

        def loss_fn(mb: MicroBatch, outputs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            lp, ent = split_outputs(outputs)  # [b, R] each
            a = mb.arrays
            old = a.get("old_logprobs")
            if old is None and use_rollout_as_old:
                old = a["rollout_logprobs"]
            loss, m = algo.policy_loss_and_metrics(
                cfg,
                lp,
                old,
                a["rollout_logprobs"],
                a["advantages"],
                mb.mask,
                ref_logprobs=a.get("ref_logprobs"),
                entropy=ent,
                global_count=global_count,
                old_is_rollout=use_rollout_as_old,
            )
            return loss * ws, m

        mine = shard(rows, self.dist.rank, ws)
        mbs = [collate(g, self.pad_id, self.dist.device, names) for g in self._micro(mine)]
        grad_norm, recs = run_micro_batches(self.engine, mbs, loss_fn, self.pad_id, tuple(names))
        out = self._merge(recs)
        out["grad_norm"] = grad_norm
        out["lr"] = self.engine.lr()
        return out

    def _critic_update(self, rows: list[Sample]) -> dict[str, float]:
        assert self.critic is not None
        alg = self.tc.algorithm
        names = ("values", "returns")
        global_count, cfg = _global_count(alg, rows)
        ws = self.dist.world_size

        def loss_fn(mb: MicroBatch, outputs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            v = outputs  # [b, R]
            loss, m = algo.value_loss_and_metrics(
                cfg, v, mb.arrays["values"], mb.arrays["returns"], mb.mask, global_count
            )
            return loss * ws, m

        mine = shard(rows, self.dist.rank, ws)
        mbs = [collate(g, self.pad_id, self.dist.device, names) for g in self._micro(mine)]
        grad_norm, recs = run_micro_batches(self.critic, mbs, loss_fn, self.pad_id, names)
        out = self._merge(recs)
        out["value/grad_norm"] = grad_norm
        return out

    def _merge(self, recs: list[tuple[dict[str, float], int]]) -> dict[str, float]:
        everyone = gather_json(recs, self.dist)
        return merge_metrics([(m, n) for rank_recs in everyone for m, n in rank_recs])

    # ------------------------------------------------------------------ SFT

    def _sft_step(self, batch: dict[str, Any]) -> dict[str, float]:
        assert self.engine is not None
        samples: list[Sample] = batch["samples"]
        total = int(sum(float(s.loss_mask.sum()) for s in samples))
        mine = shard(samples, self.dist.rank, self.dist.world_size)
        mbs = [collate(g, self.pad_id, self.dist.device) for g in self._micro(mine)]
        grad_norm, recs = run_micro_batches(
            self.engine, mbs, sft_loss_fn(total, self.dist.world_size), self.pad_id
        )
        merged = self._merge(recs)
        return {
            "loss/sft": merged.get("loss_share", float("nan")),
            "entropy": merged.get("token_entropy", float("nan")),
            "grad_norm": grad_norm,
            "lr": self.engine.lr(),
            "batch/sequences": float(len(samples)),
        }

    # ------------------------------------------------------------------ eval

    def _publish_current(self) -> None:
        """Publish the current version unless it was already (with `publish_every` > 1 the
        versions between are skipped, but an eval round and the job's end need the newest
        weights on the engines). Collective."""
        if self._published_version != self.cursor.policy_version:
            self._publish()

    def _evaluate(self) -> None:
        """Queue an eval round in the buffer and read its groups back (rank 0 only)."""
        if not self.config.data.eval:
            return
        if self.cursor.policy_version > 0:
            self._publish_current()  # the round evaluates this version's weights
        if self.dist.is_main:
            self._flush_ack()
        round_ = self.cursor.eval_round
        result = self._eval_round(round_) if self.dist.is_main else {}
        self.cursor.eval_round = round_ + 1
        if result:
            self.status.metrics.update(result)
            self._write_jsonl({"kind": "eval", "round": round_, "step": self.cursor.step, **result})
        saved = self.status.saved[0]
        if self.dist.is_main and result and saved and self.tc.mode == "rl":
            # The round's groups are consumed: a trainer resumed from the newest checkpoint
            # (written before this round) must go on with the next round, not wait for these.
            # (Not in eval mode: its checkpoints are the training job's.)
            try:
                ckpt.record_eval_round(Path(saved), self.cursor.eval_round)
            except OSError as exc:  # pruned meanwhile, or read-only: the round is still done
                log.warning("eval.round_not_recorded", path=saved, error=str(exc)[:300])
        barrier(self.dist)

    def _eval_round(self, round_: int) -> dict[str, float]:
        from kuberl.api.buffer.v1 import buffer_pb2
        from kuberl.api.common.v1 import trajectory_pb2

        try:
            started = self.buffer.StartEval(buffer_pb2.StartEvalRequest(round=round_), timeout=60)
        except Exception as exc:
            log.warning("eval.not_started", round=round_, error=str(exc)[:300])
            return {}
        want = int(started.num_prompts)
        log.info("eval.started", round=round_, prompts=want)
        seen: dict[str, Group] = {}
        deadline = time.monotonic() + self.tc.eval_timeout_seconds
        while len(seen) < want and time.monotonic() < deadline and not self.stop_event.is_set():
            try:
                resp = self.buffer.GetBatch(
                    buffer_pb2.GetBatchRequest(
                        num_groups=max(1, want - len(seen)),
                        max_staleness=-1,
                        current_version=self.cursor.policy_version,
                        consumer="trainer-eval",
                        wait_seconds=min(5.0, self.tc.batch_wait_seconds),
                        kind=trajectory_pb2.STREAM_KIND_EVAL,
                    ),
                    timeout=60,
                )
            except Exception as exc:  # buffer restarting: its un-acked eval batch comes back
                log.warning("eval.get_batch_failed", error=str(exc)[:300])
                self.stop_event.wait(1.0)
                continue
            for g in resp.groups:
                if g.epoch == round_:
                    seen[g.group_id] = Group.from_proto(g)
            self._ack(resp.batch_id)
        return eval_metrics(list(seen.values()), self.tc.eval_correct_threshold, want)

    # ------------------------------------------------------------------ publish / checkpoint

    def _set_buffer_version(self) -> None:
        if not self.dist.is_main or self.buffer is None:
            return
        from kuberl.api.buffer.v1 import buffer_pb2

        try:
            self.buffer.SetPolicyVersion(
                buffer_pb2.SetPolicyVersionRequest(version=self.cursor.policy_version), timeout=30
            )
        except Exception as exc:  # a version conflict after a resume is harmless
            log.warning("buffer.set_version_failed", error=str(exc)[:300])

    def _publish(self) -> None:
        """Stream the gathered weights to weight-sync (collective: every rank gathers)."""
        assert self.engine is not None
        if not self.tc.publish_weights or self.tc.mode == "eval":
            return
        version = self.cursor.policy_version
        self._published_version = version
        buckets = self.engine.full_parameters(self.config.weight_sync.bucket_bytes, "hf.")
        if not self.dist.is_main:
            for _ in buckets:
                pass
            return
        started = time.perf_counter()

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in buckets:
                yield from bucket

        try:
            self.publisher.publish(version, tensors())
            PUBLISH_SECONDS.observe(time.perf_counter() - started)
            self._publish_failed_at = None
            self._conflicts_retried = 0
        except Exception as exc:
            from kuberl.common.weights import VersionConflict

            conflict = isinstance(exc, VersionConflict)
            if conflict and self._conflicts_retried < PUBLISH_CONFLICT_RETRIES:
                # Refused, but weight-sync may not hold it: it restarted between Publish and
                # CommitPublish. A few retries; a refusal that lasts is a real conflict.
                conflict = self._held_elsewhere(version)
                self._conflicts_retried += 0 if conflict else 1
            PUBLISH_FAILURES.labels("version_conflict" if conflict else "error").inc()
            log.warning("weights.publish_failed", version=version, error=str(exc)[:300])
            # A conflict means weight-sync already holds this version or a newer one; any
            # other failure is retried while the trainer waits for batches (MSG_PUBLISH).
            self._publish_failed_at = None if conflict else time.monotonic()
        finally:
            for _ in buckets:  # keep the other ranks' gathers matched
                pass

    def _checkpoint(self) -> str:
        """Save engines, cursor, RNG and an HF export; collective."""
        assert self.engine is not None
        # Cleared now, not at the end: a CheckpointNow arriving while this one is written is
        # answered by it (it holds the current step), and the request it left set finds this
        # step saved and writes nothing (`_answer_saved`).
        self.checkpoint_request.clear()
        started = time.perf_counter()
        root = self.checkpoint_root
        # Rank 0 names it (never a complete checkpoint's folder) and every rank writes there.
        tag = ckpt.fresh_tag(root, self.cursor.step) if self.dist.is_main else None
        tag = broadcast_bytes(tag.encode() if tag else None, self.dist).decode()
        path = root / tag
        if self.dist.is_main:
            path.mkdir(parents=True, exist_ok=True)
        barrier(self.dist)
        self.engine.save(path / "policy", tag)
        if self.critic is not None:
            self.critic.save(path / "critic", tag)
        ckpt.write_rank_files(path, self.dist.rank)
        if self.tc.export_hf:
            named: list[tuple[str, torch.Tensor]] = []
            for bucket in self.engine.full_parameters(64 * 1024 * 1024, "hf."):
                named.extend(bucket)
            if self.dist.is_main:
                ckpt.export_hf(named, self.model_dir, path / "hf", self.tied)
        if self.dist.is_main:
            self.cursor.metrics = {k: v for k, v in self.status.metrics.items() if math.isfinite(v)}
            ckpt.write_cursor(path, self.cursor)
        ckpt.sync_tree(path)  # on disk before `latest` names it
        barrier(self.dist)
        if self.dist.is_main:
            ckpt.commit(root, path, self.tc.keep_checkpoints)
        barrier(self.dist)
        CHECKPOINT_SECONDS.observe(time.perf_counter() - started)
        self._checkpointed_at = self._position()
        self.status.saved = (str(path), self.cursor.step)
        self._answered()
        log.info(
            "checkpoint.saved", path=str(path), seconds=round(time.perf_counter() - started, 2)
        )
        if self.dist.is_main:
            self._commit_held()  # durable now: the batches it holds are acknowledged
        return str(path)

    def _answer_saved(self) -> None:
        """A CheckpointNow when the newest checkpoint holds the current step already (every
        rank decides alike): it is the answer. Saving again would only write the same weights
        to a second folder (`step-NNNNNN.1`)."""
        self.checkpoint_request.clear()
        log.info("checkpoint.already_saved", path=self.status.saved[0])
        self._answered()

    def _answered(self) -> None:
        self.status.checkpoints_answered += 1
        with self.checkpoint_done:
            self.checkpoint_done.notify_all()

    # ------------------------------------------------------------------ metrics

    def _speed(self, batch: dict[str, Any], sft: bool, seconds: float) -> dict[str, float]:
        tokens = int(batch["tokens"])
        out = {"tokens": float(tokens), "tokens_per_second": tokens / max(seconds, 1e-9)}
        TOKENS.inc(tokens)
        if self.dist.device.type == "cuda" and self.engine is not None:
            name = torch.cuda.get_device_name(self.dist.device)
            peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
            if peak:
                alg = self.tc.algorithm
                body, head = _policy_params(self.engine.module)
                critic = self.critic
                flops = step_flops(
                    body_params=body,
                    head_params=head,
                    tokens=tokens,
                    response_tokens=sum(s.response_length for s in batch["samples"]),
                    training_passes=1 if sft else alg.ppo_epochs,
                    forward_passes=0 if sft else int(alg.recompute_old_logprobs),
                    reference=not sft and self.reference is not None,
                    critic_body_params=0 if sft or critic is None else _numel(critic.module),
                    critic_training_passes=alg.ppo_epochs,
                )
                out["mfu"] = flops / (seconds * peak * self.dist.world_size)
        return out

    def _sync_status(self) -> None:
        self.status.step = self.cursor.step
        self.status.policy_version = self.cursor.policy_version
        self.status.epoch = self.cursor.epoch
        if self.cursor.metrics:
            self.status.metrics.update(self.cursor.metrics)

    def _record(self, metrics: dict[str, float], kind: str) -> None:
        # The status took the step already (`_one_step`, before the checkpoint).
        self.status.metrics.update(metrics)
        self.status.metrics["step"] = float(self.cursor.step)
        STEPS.labels(kind).inc()
        STEP_SECONDS.observe(metrics.get("step_seconds", 0.0))
        STEP_GAUGE.set(self.cursor.step)
        POLICY_VERSION.set(self.cursor.policy_version)
        for k, v in metrics.items():
            if not math.isfinite(v):
                continue
            if k.startswith("loss/"):
                LOSS.labels(k.removeprefix("loss/")).set(v)
            elif k.startswith("mismatch/"):
                MISMATCH.labels(k.removeprefix("mismatch/")).set(v)
        gauges = {
            "grad_norm": GRAD_NORM,
            "kl/ref": KL,
            "entropy": ENTROPY,
            "policy/clip_frac": CLIP_FRACTION,
            "reward/mean": REWARD,
            "tokens_per_second": TOKENS_PER_SECOND,
            "mfu": MFU,
        }
        for key, gauge in gauges.items():
            if key in metrics and math.isfinite(metrics[key]):
                gauge.set(metrics[key])
        log.info(
            "trainer.step",
            kind=kind,
            step=self.cursor.step,
            version=self.cursor.policy_version,
            **{k: round(v, 5) for k, v in metrics.items() if k in _LOGGED},
        )
        self._write_jsonl(
            {
                "kind": kind,
                "step": self.cursor.step,
                "total_steps": self.tc.total_steps,
                "policy_version": self.cursor.policy_version,
                **metrics,
            }
        )

    def _write_jsonl(self, row: dict[str, Any]) -> None:
        if not self._metrics_file or not self.dist.is_main:
            return
        row = {"time": time.time(), **row}
        clean = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in row.items()
        }
        with open(self._metrics_file, "a") as f:
            f.write(json.dumps(clean) + "\n")


def publisher_options(device: torch.device) -> dict[str, Any]:
    """How rank 0 offers its weights to weight-sync (`WeightPublisher` keyword arguments).

    On a GPU, CUDA IPC comes first: an engine on the same host and GPU (`kuberl run --device
    cuda`) then copies each version device to device from the trainer's GPU buckets, while the
    host copy still goes to the service (shared memory, else a gRPC upload) for every other
    engine. On the CPU there is nothing to share by CUDA IPC: shared memory or the upload."""
    if device.type == "cuda":
        return {"transports": ("cuda_ipc", "shm", "snapshot"), "device": str(device)}
    return {"transports": ("shm", "snapshot"), "device": "cpu"}


# Metrics that policy_loss_and_metrics aggregates with `global_count` (shares of the total).
_SHARE_KEYS = ("loss_share", "entropy", "kl/ref")

_LOGGED = (
    "loss/total",
    "loss/sft",
    "grad_norm",
    "reward/mean",
    "entropy",
    "kl/ref",
    "policy/clip_frac",
    "step_seconds",
    "tokens_per_second",
)


def _response_tensor(samples: list[Sample], name: str | None) -> torch.Tensor:
    """[B, R] right-padded: the loss mask (name None) or a response-aligned array."""
    r = max([s.response_length for s in samples] + [1])
    out = torch.zeros(len(samples), r)
    for i, s in enumerate(samples):
        n = s.response_length
        src = s.loss_mask if name is None else s.arrays[name]
        out[i, :n] = torch.from_numpy(np.asarray(src[:n], dtype=np.float32))
    return out


def _global_count(alg: Any, rows: list[Sample]) -> tuple[float, Any]:
    """The normaliser of the whole update (for exact gradient accumulation) and the config
    to use: token_sum's default length normaliser becomes the update's longest response."""
    if alg.loss_agg == "token_mean":
        count = float(sum(float(s.loss_mask.sum()) for s in rows))
    else:
        count = float(len(rows))
    cfg = alg
    if alg.loss_agg == "token_sum" and alg.loss_norm_tokens is None:
        longest = max(s.response_length for s in rows)
        cfg = alg.model_copy(update={"loss_norm_tokens": max(longest, 1)})
    return max(count, 1.0), cfg


def _numel(module: torch.nn.Module) -> int:
    """Parameters of a module, ZeRO-3's partitioned ones at their full size."""
    return sum(full_numel(p) for p in module.parameters())


def _policy_params(policy: torch.nn.Module) -> tuple[int, int]:
    """(body, head) parameter counts of a PolicyModel: the vocabulary head's [V, H] product
    runs at the response positions only; an embedding tied to it is a lookup, no FLOPs."""
    hf: Any = getattr(policy, "hf", policy)
    head = hf.get_output_embeddings().weight
    embedding = hf.get_input_embeddings().weight
    lookup = 0 if embedding is head else full_numel(embedding)
    return _numel(policy) - full_numel(head) - lookup, full_numel(head)


def merge_metrics(records: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Micro-batch (metrics, tokens) of every rank -> one dict. Terms aggregated with the
    update's global count (loss terms, entropy, KL to the reference) are each micro-batch's
    share of the update's value and add up; min/max stay min/max; the rest is token-weighted."""
    out: dict[str, float] = {}
    keys = sorted({k for m, _ in records for k in m})
    for k in keys:
        vals = [(m[k], n) for m, n in records if k in m]
        if k.startswith("loss/") or k in _SHARE_KEYS:
            out[k] = float(sum(v for v, _ in vals))
        elif k.endswith(("_min", "_max")):
            # A micro-batch without a trained token reports 0 for both (nothing to take the
            # extremes of): it once made every step's ratio_min 0.
            seen = [v for v, n in vals if n > 0] or [v for v, _ in vals]
            out[k] = float(min(seen) if k.endswith("_min") else max(seen))
        else:
            total = sum(n for _, n in vals) or 1
            out[k] = float(sum(v * n for v, n in vals) / total)
    return out


def _mean_records(records: list[dict[str, float]]) -> dict[str, float]:
    if not records:
        return {}
    keys = sorted({k for r in records for k in r})
    return {k: float(np.mean([r[k] for r in records if k in r])) for k in keys}


def _reward_metrics(samples: Sequence[Sample], threshold: float) -> dict[str, float]:
    rewards = np.array([s.reward for s in samples], dtype=np.float64)
    lengths = np.array([s.response_length for s in samples], dtype=np.float64)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/accuracy": float((rewards >= threshold).mean()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
    }


def eval_metrics(groups: Sequence[Group], threshold: float, expected: int) -> dict[str, float]:
    """Accuracy (samples with reward >= threshold), pass@n and mean reward per dataset (the
    dataset is the part of the prompt id before ':') and overall."""
    by_ds: dict[str, list[Group]] = {}
    for g in groups:
        by_ds.setdefault(g.prompt_id.partition(":")[0], []).append(g)
    out: dict[str, float] = {}
    every: list[float] = []
    for name, gs in sorted(by_ds.items()):
        rewards = [t.reward for g in gs for t in g.trajectories]
        correct = [float(r >= threshold) for r in rewards]
        passed = [float(any(t.reward >= threshold for t in g.trajectories)) for g in gs]
        out[f"eval/{name}/accuracy"] = float(np.mean(correct)) if correct else 0.0
        out[f"eval/{name}/pass_at_n"] = float(np.mean(passed)) if passed else 0.0
        out[f"eval/{name}/reward_mean"] = float(np.mean(rewards)) if rewards else 0.0
        out[f"eval/{name}/groups"] = float(len(gs))
        EVAL_ACCURACY.labels(name).set(out[f"eval/{name}/accuracy"])
        every += correct
    out["eval/accuracy"] = float(np.mean(every)) if every else 0.0
    out["eval/groups"] = float(len(groups))
    out["eval/missing_groups"] = float(max(0, expected - len(groups)))
    EVAL_ACCURACY.labels("all").set(out["eval/accuracy"])
    return out
