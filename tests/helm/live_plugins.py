"""Plugins for tests/helm/test_dashboards_live.py, loaded by the real services from the job file.

`probe` is a reward verifier (`reward.custom`) that scores 0, except for two probe responses that
make it behave like a broken verifier: "raise" raises, "hang" sleeps past the reward timeout.
`drop_a_quarter` is a buffer filter (`buffer.filters`) that drops about one prompt in four.
With them the dashboards' verifier-error, timeout, worker-restart and drop panels get a series.
"""

from __future__ import annotations

import time
import zlib

from kuberl.common.trajectory import Group
from kuberl.reward.sample import RewardSample


def probe(sample: RewardSample) -> float:
    if sample.response == "raise":
        raise RuntimeError("probe verifier: failing on purpose")
    if sample.response == "hang":
        time.sleep(60)
    return 0.0


def drop_a_quarter(group: Group) -> bool:
    return zlib.crc32(group.prompt_id.encode()) % 4 != 0
