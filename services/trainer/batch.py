"""The batch one trainer step trains on, and the checks a buffer batch's groups must pass.

A `Batch` comes from the buffer (whole groups of trajectories, with the id it is acknowledged
by) or from an SFT file (sequences only, no id). `usable_groups` leaves out the groups the model
cannot train on (token ids outside the vocabulary, empty prompts, ragged or non-finite arrays,
groups of another size) and the groups the trainer has trained on already; each is counted
with its reason.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kuberl.common import metrics as prom
from kuberl.common.logs import get_logger
from kuberl.common.trajectory import Group, TrajectoryError
from kuberl.trainer.batching import TrainingSequence

log = get_logger(__name__)

REJECTED = prom.counter(
    "kuberl_trainer_rejected_groups_total", "Groups the trainer could not train on", ["reason"]
)


@dataclass
class Rejection:
    """A group left out of a batch: its `<prompt>@<epoch>` key and why."""

    key: str
    reason: str


@dataclass
class Batch:
    """What one step trains on. `samples` hold one sequence per trajectory of `groups`, in
    order (RL), or the SFT examples (`groups` empty when they come from a file)."""

    samples: list[TrainingSequence]
    groups: list[Group] = field(default_factory=list)
    #: The buffer's id, acknowledged once trained; "" for a batch read from a file.
    batch_id: str = ""
    redelivered: bool = False
    #: Groups the buffer delivered that `usable_groups` left out.
    rejected: list[Rejection] = field(default_factory=list)
    #: Groups the buffer dropped before delivery, by reason (staleness, zero variance, ...).
    dropped: dict[str, int] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.samples)

    @property
    def group_keys(self) -> list[str]:
        return [group_key(g) for g in self.groups]

    def record(self, event: str, step: int, policy_version: int) -> dict[str, Any]:
        """The trained-batches log row (`KUBERL_TRAINED_JSONL`): each group's (prompt, epoch),
        replica and versions, so a run's accounting can tell what the weights descend from."""
        groups = []
        for g in self.groups:
            meta = g.trajectories[0].metadata if g.trajectories else {}
            groups.append(
                {
                    "key": group_key(g),
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
            "step": step,
            "policy_version": policy_version,
            "batch_id": self.batch_id,
            "redelivered": self.redelivered,
            "groups": groups,
            "rejected": [{"key": r.key, "reason": r.reason} for r in self.rejected],
        }


def group_key(group: Group) -> str:
    """The key a group is known by across batches: `<prompt>@<epoch>`."""
    return f"{group.prompt_id}@{group.epoch}"


def usable_groups(
    groups: list[Group],
    vocab_size: int,
    *,
    same_size: bool = True,
    trained: Collection[str] = (),
    rejected: list[Rejection] | None = None,
) -> list[Group]:
    """Groups the model can train on; the others are counted, logged and appended to
    `rejected`. Token ids must be inside the vocabulary, prompts non-empty, arrays of one length
    and finite, and (RL, `same_size`) a batch's groups of one size; rejection sampling's SFT
    groups keep any number of samples. A group whose key is in `trained` was trained on already
    (its batch's record lost with the last second of a Redis host's writes)."""
    sizes = [len(g.trajectories) for g in groups]
    common = max(set(sizes), key=sizes.count) if sizes else 0
    kept = []
    for g in groups:
        reason = None
        if group_key(g) in trained:
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
            elif ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                reason = "token_out_of_vocabulary"
        if reason is None:
            kept.append(g)
        else:
            REJECTED.labels(reason).inc()
            log.warning("group.rejected", group_id=g.group_id, reason=reason)
            if rejected is not None:
                rejected.append(Rejection(group_key(g), reason))
    return kept
