"""The RL step's pure parts (`kuberl.trainer.rl`): how a batch is cut into PPO mini-batches and
what a step reports about the batch it trained on. No model, no process group."""

from __future__ import annotations

import numpy as np

from kuberl.common.config import AlgorithmConfig
from kuberl.common.trajectory import Group
from kuberl.trainer.batch import Batch, Rejection
from kuberl.trainer.batching import TrainingSequence
from kuberl.trainer.rl import batch_metrics, mini_batches
from tests.integration.buffer_support import make_group

GROUP_SIZE = 2


def _samples(groups: int) -> list[TrainingSequence]:
    return [
        TrainingSequence(
            np.ones(3, np.int64), np.ones(2, np.int64), np.ones(2, np.float32), index=i
        )
        for i in range(groups * GROUP_SIZE)
    ]


def _rows(parts: list[list[TrainingSequence]]) -> list[list[int]]:
    return [[s.index for s in part] for part in parts]


def test_mini_batches_hold_whole_groups_and_every_sample_once() -> None:
    alg = AlgorithmConfig(mini_batches=2, recompute_old_logprobs=True)
    parts = _rows(mini_batches(_samples(4), GROUP_SIZE, alg, (7, 0, 0)))
    groups = [sorted({i // GROUP_SIZE for i in part}) for part in parts]
    whole = [[i for g in gs for i in range(g * GROUP_SIZE, (g + 1) * GROUP_SIZE)] for gs in groups]
    assert ([sorted(part) for part in parts], len(parts)) == (whole, 2)
    assert sorted(i for part in parts for i in part) == list(range(8))


def test_mini_batches_are_shuffled_per_step_and_epoch_only_with_several_updates() -> None:
    samples = _samples(8)
    several = AlgorithmConfig(mini_batches=2, recompute_old_logprobs=True)
    one = AlgorithmConfig(mini_batches=1)
    orders = {
        seed: _rows(mini_batches(samples, GROUP_SIZE, several, seed))
        for seed in [(7, 0, 0), (7, 0, 1)]
    }
    assert orders[(7, 0, 0)] != orders[(7, 0, 1)]
    assert orders[(7, 0, 0)] == _rows(mini_batches(samples, GROUP_SIZE, several, (7, 0, 0)))
    assert _rows(mini_batches(samples, GROUP_SIZE, one, (7, 0, 0))) == [list(range(16))]


def test_a_step_reports_the_batchs_groups_rejections_drops_and_staleness() -> None:
    groups = [Group.from_proto(make_group(f"p:{i}", version=v)) for i, v in enumerate([3, 5])]
    batch = Batch(
        samples=[],
        groups=groups,
        batch_id="train-1",
        redelivered=True,
        rejected=[Rejection("p:9@0", "group_size")],
        dropped={"stale": 2},
    )
    assert batch_metrics(batch, policy_version=6) == {
        "batch/groups": 2.0,
        "batch/rejected_groups": 1.0,
        "batch/redelivered": 1.0,
        "batch/dropped/stale": 2.0,
        "batch/staleness_max": 3.0,
    }
