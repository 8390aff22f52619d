"""Supervised fine-tuning: data and the loss, masked to the response.

Used by the `sft` mode, by the SFT warm-start before RL (`trainer.sft_steps`), and for rejection
sampling (the buffer's SFT stream holds the kept samples as groups). Examples come from a JSONL
file of `{"prompt": ..., "response": ...}` objects (`completion` is accepted for `response`), are
tokenised with the model's tokenizer (the response gets the EOS token appended so the model learns
to stop) and become `Sample`s whose loss mask covers the response only.

The loss is the token mean of -log pi(response token) over the whole optimizer batch, across
micro-batches and data-parallel ranks: each micro-batch's sum is divided by the batch's global
token count, and multiplied by the world size because DeepSpeed averages gradients over ranks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kuberl.common.trajectory import Group
from kuberl.trainer.batching import MicroBatch, Sample


class SFTDataError(ValueError):
    """The SFT file is unreadable or a line lacks what is needed; the message names the line."""


def read_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, response) pairs of a JSONL file."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as exc:
        raise SFTDataError(f"{p}: cannot read the SFT data: {exc.strerror}") from None
    pairs = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SFTDataError(f"{p}:{i}: not JSON: {exc}") from None
        if not isinstance(row, dict):
            raise SFTDataError(f"{p}:{i}: expected an object with prompt and response")
        response = row.get("response", row.get("completion"))
        if not isinstance(row.get("prompt"), str) or not isinstance(response, str):
            raise SFTDataError(
                f"{p}:{i}: expected string fields 'prompt' and 'response' (or 'completion'), "
                f"got keys {sorted(row)}"
            )
        pairs.append((row["prompt"], response))
    if not pairs:
        raise SFTDataError(f"{p}: no examples")
    return pairs


def tokenize_pairs(pairs: Sequence[tuple[str, str]], tokenizer: Any) -> list[Sample]:
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
            Sample(
                prompt_ids=np.asarray(p, dtype=np.int64),
                response_ids=np.asarray(r, dtype=np.int64),
                loss_mask=np.ones(len(r), dtype=np.float32),
                index=i,
            )
        )
    return samples


def samples_from_groups(groups: Sequence[Group]) -> list[Sample]:
    """SFT samples from the buffer's SFT stream (rejection sampling keeps whole groups)."""
    out: list[Sample] = []
    for g in groups:
        for t in g.trajectories:
            out.append(
                Sample(
                    prompt_ids=t.prompt_token_ids.astype(np.int64),
                    response_ids=t.response_token_ids.astype(np.int64),
                    loss_mask=np.asarray(t.loss_mask, dtype=np.float32),
                    reward=t.reward,
                    index=len(out),
                )
            )
    return out


def epoch_batches(
    samples: Sequence[Sample], batch_size: int, seed: int, start_epoch: int = 0
) -> Iterator[tuple[int, list[Sample]]]:
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


def _reindexed(s: Sample, index: int) -> Sample:
    return Sample(s.prompt_ids, s.response_ids, s.loss_mask, dict(s.arrays), s.reward, index)


def sft_loss_fn(global_tokens: int, world_size: int) -> Any:
    """The micro-batch loss of the batch-wide response-token mean NLL (see module doc)."""
    from kuberl.trainer.engine import split_outputs

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
