"""Custom reward functions that the reward tests load by dotted path (`reward.custom`).

Well-behaved ones and saboteurs: a function that raises, one that never returns, one that
returns NaN or a string, one that kills its own worker process, and async versions.
"""

from __future__ import annotations

import asyncio
import os
import time

from kuberl.reward.sample import RewardSample
from kuberl.reward.verifiers import Verdict


def exact_match(sample: RewardSample) -> float:
    return 1.0 if sample.response.strip() == sample.answer.strip() else 0.0


def token_count(sample: RewardSample) -> Verdict:
    n = len(sample.response_token_ids)
    return Verdict(n / 10, extras={"tokens": float(n)}, details=f"{n} tokens")


def raises(sample: RewardSample) -> float:
    raise RuntimeError("reward function exploded")


def hangs(sample: RewardSample) -> float:
    time.sleep(3600)
    return 1.0


def returns_nan(sample: RewardSample) -> float:
    return float("nan")


def returns_text(sample: RewardSample) -> str:
    return "1.0"


def exits_worker(sample: RewardSample) -> float:
    os._exit(3)


def worker_pid(sample: RewardSample) -> float:
    return float(os.getpid())


async def async_length(sample: RewardSample) -> float:
    await asyncio.sleep(0.01)
    return float(len(sample.response))


async def async_hangs(sample: RewardSample) -> float:
    await asyncio.sleep(3600)
    return 1.0


async def async_nan(sample: RewardSample) -> float:
    return float("nan")
