"""Eval rounds: `mode: eval`, `eval_every` in rl mode, and the final weights' round.

Rank 0 queues a round in the buffer (StartEval), reads back the EVAL groups rollout replicas put
and reports accuracy, pass@n and mean reward per dataset. A round's groups are read once: the
round is recorded in the newest checkpoint's cursor, so a trainer resumed from it goes on with
the next round instead of waiting for groups already consumed. A round a trainer asked for
before (one killed mid-round, which read some of its groups) is abandoned for a fresh round:
every eval prompt is issued again, so the result covers the whole eval set on the current
weights.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kuberl.api.buffer.v1 import buffer_pb2
from kuberl.api.common.v1 import trajectory_pb2
from kuberl.common import metrics as prom
from kuberl.common.config import JobConfig
from kuberl.common.logs import get_logger
from kuberl.common.trajectory import Group
from kuberl.trainer import checkpoint as ckpt
from kuberl.trainer.delivery import BatchDelivery
from kuberl.trainer.distributed import DistInfo, all_reduce_max

log = get_logger(__name__)

EVAL_ACCURACY = prom.gauge("kuberl_trainer_eval_accuracy", "Eval accuracy", ["dataset"])


class Evaluator:
    """Runs eval rounds against the buffer (rank 0; the other ranks wait in a barrier)."""

    def __init__(
        self,
        config: JobConfig,
        dist: DistInfo,
        delivery: BatchDelivery,
        stop: threading.Event,
    ) -> None:
        self.config = config
        self.tc = config.trainer
        self.dist = dist
        self.delivery = delivery
        self.stop = stop
        #: The groups of rank 0's last round (its sample tables).
        self.last_groups: list[Group] = []

    def evaluate(self, cursor: ckpt.Cursor, newest_checkpoint: str) -> dict[str, float]:
        """Round `cursor.eval_round` of the current weights (published before): its metrics
        (on rank 0, when it ran). Moves the cursor to the next round. Collective."""
        round_ = cursor.eval_round
        result: dict[str, float] = {}
        if self.dist.is_main:
            round_, result = self.round(round_, cursor.policy_version)
        cursor.eval_round = round_ + 1
        if self.dist.is_main and result and newest_checkpoint and self.tc.mode == "rl":
            # (Not in eval mode: its checkpoints are the training job's.)
            try:
                ckpt.record_eval_round(Path(newest_checkpoint), cursor.eval_round)
            except OSError as exc:  # pruned meanwhile, or read-only: the round is still done
                log.warning("eval.round_not_recorded", path=newest_checkpoint, error=str(exc)[:300])
        # Every rank's cursor takes the round rank 0 ran (collective, like a barrier).
        cursor.eval_round = all_reduce_max(cursor.eval_round, self.dist)
        return result

    def round(self, round_: int, policy_version: int) -> tuple[int, dict[str, float]]:
        """Queue round `round_` (or a fresh one, see the module docstring) and read its groups
        until all are back or the timeout: (the round that ran, its metrics)."""
        buffer = self.delivery.stub
        try:
            started = buffer.StartEval(buffer_pb2.StartEvalRequest(round=round_), timeout=60)
            if not started.started:
                abandoned, round_ = round_, max(round_ + 1, int(started.rounds))
                log.warning("eval.round_abandoned", round=abandoned, fresh_round=round_)
                started = buffer.StartEval(buffer_pb2.StartEvalRequest(round=round_), timeout=60)
        except Exception as exc:
            log.warning("eval.not_started", round=round_, error=str(exc)[:300])
            return round_, {}
        want = int(started.num_prompts)
        log.info("eval.started", round=round_, prompts=want)
        seen: dict[str, Group] = {}
        deadline = time.monotonic() + self.tc.eval_timeout_seconds
        while len(seen) < want and time.monotonic() < deadline and not self.stop.is_set():
            try:
                resp = buffer.GetBatch(
                    buffer_pb2.GetBatchRequest(
                        num_groups=max(1, want - len(seen)),
                        max_staleness=-1,
                        current_version=policy_version,
                        consumer="trainer-eval",
                        wait_seconds=min(5.0, self.tc.batch_wait_seconds),
                        kind=trajectory_pb2.STREAM_KIND_EVAL,
                    ),
                    timeout=60,
                )
            except Exception as exc:  # buffer restarting: its un-acked eval batch comes back
                log.warning("eval.get_batch_failed", error=str(exc)[:300])
                self.stop.wait(1.0)
                continue
            for g in resp.groups:
                if g.epoch == round_:
                    seen[g.group_id] = Group.from_proto(g)
            self.delivery.ack(resp.batch_id)
        self.last_groups = list(seen.values())
        return round_, eval_metrics(self.last_groups, self.tc.eval_correct_threshold, want)


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
