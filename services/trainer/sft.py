"""Supervised fine-tuning: data, the loss masked to the response, and the SFT step.

Used by the `sft` mode, by the SFT warm-start before RL (`trainer.sft_steps`), and for rejection
sampling (the buffer's SFT stream holds the kept samples as groups). Examples come from a JSONL
or Parquet file of `{"prompt": ..., "response": ...}` records (`completion` is accepted for
`response`), are tokenised with the model's tokenizer (the response gets the EOS token appended
so the model learns to stop) and become `TrainingSequence`s whose loss mask covers the response
only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kuberl.common.config import JobConfig
from kuberl.common.datasets import read_records
from kuberl.common.errors import InvalidArgument
from kuberl.common.trajectory import Group
from kuberl.trainer.batch import Batch
from kuberl.trainer.batching import MicroBatch, TrainingSequence, rank_micro_batches
from kuberl.trainer.distributed import DistInfo
from kuberl.trainer.engine import run_micro_batches, split_outputs
from kuberl.trainer.models import Models
from kuberl.trainer.telemetry import merge_ranks


class SFTDataError(ValueError):
    """The SFT file is unreadable or a line lacks what is needed; the message names the line."""


def read_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, response) pairs of a JSONL or Parquet file."""
    p = Path(path)
    pairs = []
    try:
        for i, row in read_records(p):
            response = row.get("response", row.get("completion"))
            if not isinstance(row.get("prompt"), str) or not isinstance(response, str):
                raise SFTDataError(
                    f"{p}:{i}: expected string fields 'prompt' and 'response' (or 'completion'), "
                    f"got keys {sorted(row)}"
                )
            pairs.append((row["prompt"], response))
    except InvalidArgument as exc:  # not JSON, not an object per line, not a data file
        raise SFTDataError(str(exc)) from None
    except OSError as exc:
        raise SFTDataError(f"{p}: cannot read the SFT data: {exc.strerror}") from None
    if not pairs:
        raise SFTDataError(f"{p}: no examples")
    return pairs


def tokenize_pairs(pairs: Sequence[tuple[str, str]], tokenizer: Any) -> list[TrainingSequence]:
    """Samples whose loss mask covers the response tokens and the appended EOS."""
    eos = tokenizer.eos_token_id
    samples = []
    for i, (prompt, response) in enumerate(pairs):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"]
        if eos is not None:
            r = [*r, eos]
        if not p:
            p = [eos if eos is not None else 0]
        samples.append(
            TrainingSequence(
                prompt_ids=np.asarray(p, dtype=np.int64),
                response_ids=np.asarray(r, dtype=np.int64),
                loss_mask=np.ones(len(r), dtype=np.float32),
                index=i,
            )
        )
    return samples


def samples_from_groups(groups: Sequence[Group]) -> list[TrainingSequence]:
    """SFT samples from the buffer's SFT stream (rejection sampling keeps whole groups)."""
    out: list[TrainingSequence] = []
    for g in groups:
        for t in g.trajectories:
            out.append(
                TrainingSequence(
                    prompt_ids=t.prompt_token_ids.astype(np.int64),
                    response_ids=t.response_token_ids.astype(np.int64),
                    loss_mask=np.asarray(t.loss_mask, dtype=np.float32),
                    reward=t.reward,
                    index=len(out),
                )
            )
    return out


def epoch_batches(
    samples: Sequence[TrainingSequence], batch_size: int, seed: int, start_epoch: int = 0
) -> Iterator[tuple[int, list[TrainingSequence]]]:
    """Endless (epoch, batch) over shuffled samples; epoch e is shuffled with (seed, e)."""
    epoch = start_epoch
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(len(samples))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            batch = [samples[int(i)] for i in order[start : start + batch_size]]
            yield epoch, [_reindexed(s, k) for k, s in enumerate(batch)]
        if len(order) < batch_size:
            yield epoch, [_reindexed(samples[int(i)], k) for k, i in enumerate(order)]
        epoch += 1


def _reindexed(s: TrainingSequence, index: int) -> TrainingSequence:
    return TrainingSequence(
        s.prompt_ids, s.response_ids, s.loss_mask, dict(s.arrays), s.reward, index
    )


def sft_loss_fn(global_tokens: int, world_size: int) -> Any:
    """The micro-batch loss of the token mean of -log pi(response token) over the whole
    optimizer batch, across micro-batches and data-parallel ranks: each micro-batch's sum is
    divided by the batch's global token count, and multiplied by the world size because
    DeepSpeed averages gradients over ranks."""

    def loss_fn(mb: MicroBatch, outputs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        lp, ent = split_outputs(outputs)  # [b, R] each
        nll_sum = -(lp * mb.mask).sum()
        share = nll_sum / max(global_tokens, 1)
        tokens = max(mb.num_tokens, 1)
        metrics = {
            "loss_share": float(share.detach()),
            "nll": float(nll_sum.detach()) / tokens,
            "token_entropy": float((ent * mb.mask).sum().detach()) / tokens,
        }
        return share * world_size, metrics

    return loss_fn


class SFTFile:
    """The batches of `trainer.sft_data`, shuffled per epoch, from where a checkpoint left off."""

    def __init__(self, samples: list[TrainingSequence], batch_size: int, seed: int) -> None:
        self.samples = samples
        self.batch_size = batch_size
        self.seed = seed
        self._batches: Iterator[tuple[int, list[TrainingSequence]]] | None = None

    @classmethod
    def load(cls, config: JobConfig, base_dir: Path, tokenizer: Any) -> SFTFile | None:
        """The job's SFT file, tokenised now (a bad file fails the start, not step 1); None
        when the job reads no SFT file."""
        tc = config.trainer
        if not (tc.sft_data and (tc.mode == "sft" or tc.sft_steps)):
            return None
        path = Path(tc.sft_data)
        path = path if path.is_absolute() else base_dir / path
        return cls(tokenize_pairs(read_pairs(path), tokenizer), tc.sft_batch_size, config.job.seed)

    def next_batch(self, done: int) -> tuple[int, Batch]:
        """(epoch, batch) of the step after `done` steps; the first call skips what they saw."""
        if self._batches is None:
            per_epoch = max(1, len(self.samples) // self.batch_size)
            self._batches = epoch_batches(
                self.samples, self.batch_size, self.seed, done // per_epoch
            )
            for _ in range(done % per_epoch):
                next(self._batches)
        epoch, samples = next(self._batches)
        return epoch, Batch(samples=samples)


class SFTStep:
    """One SFT optimizer step of the policy (every rank runs it on the same batch)."""

    def __init__(self, config: JobConfig, models: Models, dist: DistInfo) -> None:
        self.tc = config.trainer
        self.models = models
        self.dist = dist

    def __call__(self, batch: Batch) -> dict[str, float]:
        engine = self.models.engine
        samples = batch.samples
        total = int(sum(float(s.loss_mask.sum()) for s in samples))
        mbs = rank_micro_batches(samples, self.dist, self.tc.micro_batch_tokens, self.models.pad_id)
        loss_fn = sft_loss_fn(total, self.dist.world_size)
        grad_norm, recs = run_micro_batches(engine, mbs, loss_fn, self.models.pad_id)
        merged = merge_ranks(recs, self.dist)
        return {
            "loss/sft": merged.get("loss_share", float("nan")),
            "entropy": merged.get("token_entropy", float("nan")),
            "grad_norm": grad_norm,
            "lr": engine.lr(),
            "batch/sequences": float(len(samples)),
        }
