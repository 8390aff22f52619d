"""Which weights a replica waits for before generating a leased training batch
(`kuberl.rollout.worker.oldest_trainable_version`; the wait itself runs against real services
in tests/integration/test_rollout_service.py)."""

from __future__ import annotations

import pytest

from kuberl.rollout.worker import oldest_trainable_version


@pytest.mark.parametrize(
    ("policy_version", "max_staleness", "publish_every", "oldest"),
    [
        (3, 1, 1, 2),  # one version behind is still trained
        (3, 0, 1, 3),  # strictly on-policy: the trainer's own version
        (0, 1, 1, -1),  # nothing to wait for at the start
        (4, 0, 3, 3),  # version 4 is never published with publish_every 3: 3 is the newest
        (7, 1, 3, 6),  # 7 - 1 = 6, and 6 is a published version
        (8, 1, 3, 6),  # 8 - 1 = 7 is not published: 6 is the newest there is
        (9, 5, 3, 4),  # a staleness bound wider than the publishing gap
    ],
)
def test_the_oldest_trainable_version_by_hand(
    policy_version: int, max_staleness: int, publish_every: int, oldest: int
) -> None:
    assert oldest_trainable_version(policy_version, max_staleness, publish_every) == oldest
