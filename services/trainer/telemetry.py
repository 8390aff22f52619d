"""What the trainer reports about its steps: Prometheus gauges, the structured step log, the
metrics JSONL (`KUBERL_METRICS_JSONL`), the experiment trackers (`tracking`), the
trained-batches JSONL (`KUBERL_TRAINED_JSONL`, read by `kuberl run --chaos` accounting),
throughput and model FLOPs utilisation, and how the micro-batch metrics of every rank merge into
one figure per step."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kuberl.common import metrics as prom
from kuberl.common.config import AlgorithmConfig
from kuberl.common.logs import get_logger
from kuberl.common.trajectory import Group
from kuberl.trainer.batch import Batch
from kuberl.trainer.distributed import DistInfo, gather_json
from kuberl.trainer.engine import full_numel
from kuberl.trainer.models import Models
from kuberl.trainer.tracking import Tracking

log = get_logger(__name__)

METRICS_JSONL_ENV = "KUBERL_METRICS_JSONL"
TRAINED_JSONL_ENV = "KUBERL_TRAINED_JSONL"

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

_GAUGES = {
    "grad_norm": GRAD_NORM,
    "kl/ref": KL,
    "entropy": ENTROPY,
    "policy/clip_frac": CLIP_FRACTION,
    "reward/mean": REWARD,
    "tokens_per_second": TOKENS_PER_SECOND,
    "mfu": MFU,
}

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


def numel(module: torch.nn.Module) -> int:
    """Parameters of a module, ZeRO-3's partitioned ones at their full size."""
    return sum(full_numel(p) for p in module.parameters())


def policy_params(policy: torch.nn.Module) -> tuple[int, int]:
    """(body, head) parameter counts of a PolicyModel: the vocabulary head's [V, H] product
    runs at the response positions only; an embedding tied to it is a lookup, no FLOPs."""
    hf: Any = getattr(policy, "hf", policy)
    head = hf.get_output_embeddings().weight
    embedding = hf.get_input_embeddings().weight
    lookup = 0 if embedding is head else full_numel(embedding)
    return numel(policy) - full_numel(head) - lookup, full_numel(head)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, None off a known GPU (no MFU then)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def speed(
    batch: Batch, seconds: float, models: Models, alg: AlgorithmConfig, sft: bool, dist: DistInfo
) -> dict[str, float]:
    """Tokens, throughput and (on a known GPU) MFU of a step that took `seconds`."""
    tokens = batch.tokens
    out = {"tokens": float(tokens), "tokens_per_second": tokens / max(seconds, 1e-9)}
    TOKENS.inc(tokens)
    peak = peak_flops(dist.device) if models.policy is not None else None
    if peak:
        body, head = policy_params(models.engine.module)
        critic = models.critic
        flops = step_flops(
            body_params=body,
            head_params=head,
            tokens=tokens,
            response_tokens=sum(s.response_length for s in batch.samples),
            training_passes=1 if sft else alg.ppo_epochs,
            forward_passes=0 if sft else int(alg.recompute_old_logprobs),
            reference=not sft and models.reference is not None,
            critic_body_params=0 if sft or critic is None else numel(critic.module),
            critic_training_passes=alg.ppo_epochs,
        )
        out["mfu"] = flops / (seconds * peak * dist.world_size)
    return out


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
            # extremes of): only micro-batches with tokens count, when there are any.
            seen = [v for v, n in vals if n > 0] or [v for v, _ in vals]
            out[k] = float(min(seen) if k.endswith("_min") else max(seen))
        else:
            total = sum(n for _, n in vals) or 1
            out[k] = float(sum(v * n for v, n in vals) / total)
    return out


def merge_ranks(records: list[tuple[dict[str, float], int]], dist: DistInfo) -> dict[str, float]:
    """`merge_metrics` over this rank's micro-batch records and every other rank's. Collective."""
    everyone = gather_json(records, dist)
    return merge_metrics([(m, n) for rank_records in everyone for m, n in rank_records])


class Reporter:
    """Rank 0's step reports: gauges, the step log line, the metrics JSONL and the trackers
    (`tracking`, set by the trainer's setup on rank 0), whose x-axis is `trained`: the steps
    trained so far, an RL job's SFT warm-up included; SFT steps' metrics go to the trackers
    under `sft/`."""

    def __init__(self, dist: DistInfo, total_steps: int) -> None:
        self.dist = dist
        self.total_steps = total_steps
        self.metrics_file = os.environ.get(METRICS_JSONL_ENV)
        self.tracking: Tracking | None = None

    def step(
        self,
        metrics: dict[str, float],
        kind: str,
        step: int,
        version: int,
        batch: Batch | None = None,
        trained: int | None = None,
    ) -> None:
        STEPS.labels(kind).inc()
        STEP_SECONDS.observe(metrics.get("step_seconds", 0.0))
        STEP_GAUGE.set(step)
        POLICY_VERSION.set(version)
        for k, v in metrics.items():
            if not math.isfinite(v):
                continue
            if k.startswith("loss/"):
                LOSS.labels(k.removeprefix("loss/")).set(v)
            elif k.startswith("mismatch/"):
                MISMATCH.labels(k.removeprefix("mismatch/")).set(v)
        for key, gauge in _GAUGES.items():
            if key in metrics and math.isfinite(metrics[key]):
                gauge.set(metrics[key])
        log.info(
            "trainer.step",
            kind=kind,
            step=step,
            version=version,
            **{k: round(v, 5) for k, v in metrics.items() if k in _LOGGED},
        )
        # The trackers are handed a step before metrics.jsonl has it: a line there means
        # every tracker had the step (what `kuberl` and the tests watch).
        if self.tracking is not None:
            trained = step if trained is None else trained
            values = {**metrics, "step": step, "policy_version": version}
            if kind == "sft":  # a warm-up shares its RL job's runs and names: kept apart
                values = {f"sft/{k}": v for k, v in values.items()}
            self.tracking.metrics(values, trained)
            if batch is not None:
                self.tracking.train_samples(batch, trained)
        self.write(
            {
                "kind": kind,
                "step": step,
                "total_steps": self.total_steps,
                "policy_version": version,
                **metrics,
            }
        )

    def eval(
        self, result: dict[str, float], round_: int, step: int, groups: list[Group], trained: int
    ) -> None:
        """An eval round's metrics and samples (rank 0)."""
        self.write({"kind": "eval", "round": round_, "step": step, **result})
        if self.tracking is not None:
            self.tracking.metrics({**result, "eval/round": round_}, trained)
            self.tracking.eval_samples(groups, trained)

    def close(self) -> None:
        if self.tracking is not None:
            self.tracking.close()
            self.tracking = None

    def write(self, row: dict[str, Any]) -> None:
        """One row of the metrics JSONL (rank 0); non-finite figures become null."""
        if not self.metrics_file or not self.dist.is_main:
            return
        row = {"time": time.time(), **row}
        clean = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in row.items()
        }
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps(clean) + "\n")


class TrainedLog:
    """The trained-batches JSONL: one row per trained batch and one per start (rank 0), so a
    run's accounting can tell which steps the final weights descend from."""

    def __init__(self, path: str | Path | None, is_main: bool) -> None:
        self.path = path
        self.is_main = is_main

    @classmethod
    def from_env(cls, is_main: bool) -> TrainedLog:
        return cls(os.environ.get(TRAINED_JSONL_ENV), is_main)

    def write(self, row: dict[str, Any]) -> None:
        if not self.path or not self.is_main:
            return
        line = json.dumps({"time": time.time(), **row}) + "\n"
        with open(self.path, "ab+") as f:
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
