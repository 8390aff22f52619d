"""From sequences to micro-batches: data-parallel sharding, token-budget bucketing, padding.

A training batch is a list of `TrainingSequence`s (prompt ids, response ids, response-aligned
arrays such as rollout logprobs and advantages). The algorithms see response-aligned tensors
`[B, R]`; the model sees `input_ids [b, T]` with T = prompt + response. `collate` builds both
views of a micro-batch and the index that maps one to the other (`gather_index`: the positions
of the model's `[b, T-1]` next-token outputs that score the response). The trainer's models
compute their outputs at those positions only (`PolicyModel.forward(..., positions)`),
response-aligned; `to_response` maps outputs of every position the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kuberl.trainer.distributed import DistInfo


@dataclass
class TrainingSequence:
    """One tokenised sequence to train on (a rollout sample or an SFT example). `arrays` are
    response-aligned float32 [R] (advantages, ...)."""

    prompt_ids: np.ndarray  # int [P]
    response_ids: np.ndarray  # int [R]
    loss_mask: np.ndarray  # [R], 1 where trained on
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    reward: float = 0.0
    index: int = 0  # position in the step's batch

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def response_length(self) -> int:
        return len(self.response_ids)


@dataclass
class MicroBatch:
    """Padded tensors of a few samples; `weight` 0 marks a padding micro-batch (no samples)."""

    input_ids: torch.Tensor  # [b, T]
    attention_mask: torch.Tensor  # [b, T]
    gather_index: torch.Tensor  # [b, R] positions in the model's [b, T-1] outputs
    mask: torch.Tensor  # [b, R] float, 1 on trained response tokens
    arrays: dict[str, torch.Tensor]  # name -> [b, R]
    indices: list[int]  # TrainingSequence.index of each row
    response_lengths: list[int]

    @property
    def is_padding(self) -> bool:
        return not self.indices

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum().item())

    def to_response(self, per_position: torch.Tensor) -> torch.Tensor:
        """Model outputs [b, T-1] -> response-aligned [b, R]."""
        return per_position.gather(1, self.gather_index)


def shard(
    samples: Sequence[TrainingSequence], rank: int, world_size: int
) -> list[TrainingSequence]:
    """This rank's share: sorted by length, dealt round-robin (balanced token counts)."""
    ordered = sorted(samples, key=lambda s: (-s.length, s.index))
    return ordered[rank::world_size]


def micro_batches(
    samples: Sequence[TrainingSequence], budget_tokens: int
) -> list[list[TrainingSequence]]:
    """Group samples so that each group's padded size (longest * count) fits the budget: sorted
    by length and filled in order, so padding stays small because neighbours have similar
    lengths. A sequence longer than the budget gets a micro-batch of its own."""
    ordered = sorted(samples, key=lambda s: (-s.length, s.index))
    groups: list[list[TrainingSequence]] = []
    current: list[TrainingSequence] = []
    longest = 0
    for s in ordered:
        new_longest = max(longest, s.length)
        if current and new_longest * (len(current) + 1) > budget_tokens:
            groups.append(current)
            current, new_longest = [], s.length
        current.append(s)
        longest = new_longest
    if current:
        groups.append(current)
    return groups


def collate(
    samples: Sequence[TrainingSequence],
    pad_id: int,
    device: torch.device,
    names: Sequence[str] = (),
) -> MicroBatch:
    """Right-padded model inputs and response-aligned tensors for `samples`."""
    if not samples:
        return padding_micro_batch(pad_id, device, names)
    t = max(s.length for s in samples)
    r = max(max(s.response_length for s in samples), 1)
    b = len(samples)
    input_ids = np.full((b, t), pad_id, dtype=np.int64)
    attention = np.zeros((b, t), dtype=np.int64)
    gather = np.zeros((b, r), dtype=np.int64)
    mask = np.zeros((b, r), dtype=np.float32)
    arrays = {name: np.zeros((b, r), dtype=np.float32) for name in names}
    for i, s in enumerate(samples):
        p, n = len(s.prompt_ids), s.response_length
        input_ids[i, :p] = s.prompt_ids
        input_ids[i, p : p + n] = s.response_ids
        attention[i, : p + n] = 1
        # Output position p-1+j predicts response token j.
        gather[i, :n] = np.arange(p - 1, p - 1 + n)
        gather[i, n:] = max(p - 1, 0)
        mask[i, :n] = s.loss_mask[:n]
        for name in names:
            arrays[name][i, :n] = s.arrays[name]
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids).to(device),
        attention_mask=torch.from_numpy(attention).to(device),
        gather_index=torch.from_numpy(gather).to(device),
        mask=torch.from_numpy(mask).to(device),
        arrays={k: torch.from_numpy(v).to(device) for k, v in arrays.items()},
        indices=[s.index for s in samples],
        response_lengths=[s.response_length for s in samples],
    )


def rank_micro_batches(
    samples: Sequence[TrainingSequence],
    dist: DistInfo,
    budget_tokens: int,
    pad_id: int,
    names: Sequence[str] = (),
) -> list[MicroBatch]:
    """This rank's share of `samples`, collated into token-budget micro-batches."""
    mine = shard(samples, dist.rank, dist.world_size)
    return [collate(g, pad_id, dist.device, names) for g in micro_batches(mine, budget_tokens)]


def padding_micro_batch(pad_id: int, device: torch.device, names: Sequence[str] = ()) -> MicroBatch:
    """A two-token micro-batch with an empty mask, run by a rank that has run out of samples so
    that every rank makes the same collective calls (ZeRO-3 gathers, ZeRO-2 reductions)."""
    return MicroBatch(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.long, device=device),
        attention_mask=torch.ones((1, 2), dtype=torch.long, device=device),
        gather_index=torch.zeros((1, 1), dtype=torch.long, device=device),
        mask=torch.zeros((1, 1), device=device),
        arrays={k: torch.zeros((1, 1), device=device) for k in names},
        indices=[],
        response_lengths=[],
    )


def response_tensor(
    samples: Sequence[TrainingSequence], values: Sequence[np.ndarray] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded response-aligned [B, R] of `values` (default zeros) and the loss mask."""
    b = len(samples)
    r = max([s.response_length for s in samples] + [1])
    out = np.zeros((b, r), dtype=np.float32)
    mask = np.zeros((b, r), dtype=np.float32)
    for i, s in enumerate(samples):
        n = s.response_length
        mask[i, :n] = s.loss_mask[:n]
        if values is not None:
            out[i, :n] = values[i][:n]
    return torch.from_numpy(out), torch.from_numpy(mask)
