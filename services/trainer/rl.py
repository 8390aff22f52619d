"""One RL step on a batch of whole groups: advantages, then the policy (and critic) updates.

    old logprobs recomputed by the trainer if configured (else the rollout's, with TIS/MIS),
    reference logprobs (KL) and critic values: each rank on its share, summed over ranks
    -> advantages (`algorithms.compute_advantages`, the whole batch on every rank)
    -> ppo_epochs x mini_batches optimizer updates, each over token-budget micro-batches

The step talks to no service: the batch comes in, metrics go out, and the only communication is
among the trainer's own ranks. The losses are `algorithms`' pure functions; what is here decides
which tensors they get.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kuberl.common.config import AlgorithmConfig, JobConfig
from kuberl.trainer import algorithms as algo
from kuberl.trainer.batch import Batch
from kuberl.trainer.batching import MicroBatch, TrainingSequence, rank_micro_batches
from kuberl.trainer.distributed import DistInfo
from kuberl.trainer.engine import TrainEngine, run_forward, run_micro_batches, split_outputs
from kuberl.trainer.models import Models
from kuberl.trainer.telemetry import merge_ranks


class RLStep:
    """The RL update of the models in `models` (every rank runs it on the same batch)."""

    def __init__(self, config: JobConfig, models: Models, dist: DistInfo) -> None:
        self.config = config
        self.tc = config.trainer
        self.models = models
        self.dist = dist

    def __call__(self, batch: Batch, step: int, policy_version: int) -> dict[str, float]:
        """Train on `batch` as step `step` (it seeds the mini-batch order); its metrics."""
        alg = self.tc.algorithm
        samples, groups = batch.samples, batch.groups
        group_size = len(groups[0].trajectories)  # `usable_groups` kept groups of one size
        trajectories = [t for g in groups for t in g.trajectories]
        for s, t in zip(samples, trajectories, strict=True):
            s.arrays["rollout_logprobs"] = np.asarray(t.rollout_logprobs, dtype=np.float32)
        for name, per_token in self.advantages(samples, group_size).items():
            for i, s in enumerate(samples):
                s.arrays[name] = per_token[i, : s.response_length].numpy()

        updates = alg.ppo_epochs * alg.mini_batches
        records: list[dict[str, float]] = []
        for epoch in range(alg.ppo_epochs):
            for rows in mini_batches(samples, group_size, alg, (self.config.job.seed, step, epoch)):
                records.append(self.policy_update(rows, updates))
                if self.models.critic is not None:
                    records[-1].update(self.critic_update(rows))
        metrics = mean_records(records)
        metrics.update(reward_metrics(samples, self.tc.eval_correct_threshold))
        metrics.update(batch_metrics(batch, policy_version))
        return metrics

    def advantages(
        self, samples: list[TrainingSequence], group_size: int
    ) -> dict[str, torch.Tensor]:
        """Advantages and returns, and the per-token figures they came from, each [B, R]."""
        alg = self.tc.algorithm
        models = self.models
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)  # [B]
        mask = response_tensor(samples, None)  # [B, R]
        rollout_lp = response_tensor(samples, "rollout_logprobs")  # [B, R]

        def logprobs(o: torch.Tensor) -> torch.Tensor:
            return split_outputs(o)[0]

        named: dict[str, torch.Tensor] = {}
        if alg.recompute_old_logprobs:
            named["old_logprobs"] = self.forward_all(samples, logprobs, models.engine.forward)
        if models.reference is not None:
            with models.reference.resident():
                named["ref_logprobs"] = self.forward_all(
                    samples, logprobs, models.reference.forward
                )
        if models.critic is not None:
            named["values"] = self.forward_all(samples, lambda o: o, models.critic.forward)
        ref_lp = named.get("ref_logprobs")
        sampling_lp = named.get("old_logprobs", rollout_lp)
        advantages, returns = algo.compute_advantages(
            alg,
            rewards,
            mask,
            group_size,
            values=named.get("values"),
            old_logprobs=sampling_lp if ref_lp is not None else None,
            ref_logprobs=ref_lp,
        )
        return {"advantages": advantages, "returns": returns, **named}

    def forward_all(
        self,
        samples: list[TrainingSequence],
        pick: Callable[[torch.Tensor], torch.Tensor],
        forward: Any,
    ) -> torch.Tensor:
        """A per-token model output for every sample, response-aligned [B, R]: each rank
        computes its share, an all-reduce (sum over disjoint rows) gives everyone all rows."""
        mbs = self._micro_batches(samples)
        outs = run_forward(forward, mbs, self.models.pad_id, self.dist)
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

    def policy_update(self, rows: list[TrainingSequence], updates: int) -> dict[str, float]:
        """One optimizer update of the policy on `rows`, of `updates` per step."""
        names = ["advantages", "rollout_logprobs"]
        names += [n for n in ("old_logprobs", "ref_logprobs") if n in rows[0].arrays]
        global_count, cfg = global_normaliser(self.tc.algorithm, rows)
        ws = self.dist.world_size
        # Several updates per step without recomputed old logprobs: the rollout's stand in.
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

        out, grad_norm = self._update(self.models.engine, rows, loss_fn, names)
        out["grad_norm"] = grad_norm
        out["lr"] = self.models.engine.lr()
        return out

    def critic_update(self, rows: list[TrainingSequence]) -> dict[str, float]:
        """One optimizer update of the critic on `rows`."""
        assert self.models.critic is not None
        global_count, cfg = global_normaliser(self.tc.algorithm, rows)
        ws = self.dist.world_size

        def loss_fn(mb: MicroBatch, outputs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            v = outputs  # [b, R]
            loss, m = algo.value_loss_and_metrics(
                cfg, v, mb.arrays["values"], mb.arrays["returns"], mb.mask, global_count
            )
            return loss * ws, m

        out, grad_norm = self._update(self.models.critic, rows, loss_fn, ["values", "returns"])
        out["value/grad_norm"] = grad_norm
        return out

    def _update(
        self, engine: TrainEngine, rows: list[TrainingSequence], loss_fn: Any, names: list[str]
    ) -> tuple[dict[str, float], float]:
        mbs = self._micro_batches(rows, names)
        grad_norm, recs = run_micro_batches(engine, mbs, loss_fn, self.models.pad_id, tuple(names))
        return merge_ranks(recs, self.dist), grad_norm

    def _micro_batches(
        self, samples: Sequence[TrainingSequence], names: Sequence[str] = ()
    ) -> list[MicroBatch]:
        return rank_micro_batches(
            samples, self.dist, self.tc.micro_batch_tokens, self.models.pad_id, names
        )


# ---------------------------------------------------------------------- pure helpers


def mini_batches(
    samples: list[TrainingSequence],
    group_size: int,
    alg: AlgorithmConfig,
    seed: tuple[int, int, int],
) -> list[list[TrainingSequence]]:
    """One PPO epoch's mini-batches of whole groups: shuffled by `seed` (job seed, step,
    epoch) when a step makes several updates, in order otherwise; empty ones left out."""
    n_groups = len(samples) // group_size
    updates = alg.ppo_epochs * alg.mini_batches
    order = np.random.default_rng(list(seed))
    idx = order.permutation(n_groups) if updates > 1 else np.arange(n_groups)
    parts = []
    for part in np.array_split(idx, alg.mini_batches):
        rows = [s for g in part for s in samples[g * group_size : (g + 1) * group_size]]
        if rows:
            parts.append(rows)
    return parts


def response_tensor(samples: Sequence[TrainingSequence], name: str | None) -> torch.Tensor:
    """[B, R] right-padded: the loss mask (name None) or a response-aligned array."""
    r = max([s.response_length for s in samples] + [1])
    out = torch.zeros(len(samples), r)
    for i, s in enumerate(samples):
        n = s.response_length
        src = s.loss_mask if name is None else s.arrays[name]
        out[i, :n] = torch.from_numpy(np.asarray(src[:n], dtype=np.float32))
    return out


def global_normaliser(
    alg: AlgorithmConfig, rows: Sequence[TrainingSequence]
) -> tuple[float, AlgorithmConfig]:
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


def mean_records(records: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each figure over a step's updates."""
    if not records:
        return {}
    keys = sorted({k for r in records for k in r})
    return {k: float(np.mean([r[k] for r in records if k in r])) for k in keys}


def reward_metrics(samples: Sequence[TrainingSequence], threshold: float) -> dict[str, float]:
    rewards = np.array([s.reward for s in samples], dtype=np.float64)
    lengths = np.array([s.response_length for s in samples], dtype=np.float64)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/accuracy": float((rewards >= threshold).mean()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
    }


def batch_metrics(batch: Batch, policy_version: int) -> dict[str, float]:
    """What the buffer delivered: groups, left out, re-delivered, dropped, staleness."""
    out = {
        "batch/groups": float(len(batch.groups)),
        "batch/rejected_groups": float(len(batch.rejected)),
        "batch/redelivered": float(batch.redelivered),
    }
    for reason, n in batch.dropped.items():
        out[f"batch/dropped/{reason}"] = float(n)
    versions = [t.policy_version_start for g in batch.groups for t in g.trajectories]
    out["batch/staleness_max"] = float(policy_version - min(versions))
    return out
