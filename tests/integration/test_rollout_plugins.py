"""Job plugins that the rollout integration tests load into real service processes by their
`module:function` path (a reward function for the reward service, a rollout function that never
finishes for a replica that is killed mid-batch, one that waits between two engine calls as a
multi-turn sample waits for its tool), plus checks of the plugins themselves. Only light imports
here: reward worker processes import this module."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

MARKER_ENV = "KUBERL_TEST_ROLLOUT_MARKER"


def parity_reward(sample: Any) -> float:
    """1.0 when the response starts with a character of odd code point, else 0.0: a reward that
    splits random samples roughly in half, for rejection sampling."""
    return float(bool(sample.response) and ord(sample.response[0]) % 2 == 1)


async def stuck_rollout(context: Any, prompt: Any) -> list[Any]:
    """Record the prompt id in $KUBERL_TEST_ROLLOUT_MARKER, then never return (the replica is
    to be SIGKILLed while it holds the lease)."""
    with Path(os.environ[MARKER_ENV]).open("a") as f:
        f.write(prompt.prompt_id + "\n")
    await asyncio.sleep(3600)
    return []


# Prompt ids whose `two_call_rollout` is between its engine calls (the test in this process
# waits for one).
BETWEEN_CALLS: set[str] = set()


async def two_call_rollout(context: Any, prompt: Any) -> list[Any]:
    """Each sample in two engine calls of 4 tokens with a second between them, as a multi-turn
    sample waits for its tool: in flight, yet nothing of it is inside the engine."""
    from kuberl.rollout.functions import RolloutSample

    first = (
        await context.engine.generate([prompt.token_ids], context.sampling.with_(max_new_tokens=4))
    )[0]
    BETWEEN_CALLS.add(prompt.prompt_id)
    await asyncio.sleep(1.0)
    BETWEEN_CALLS.discard(prompt.prompt_id)
    params = context.sampling.with_(n=1, max_new_tokens=4)
    second = await context.engine.generate([prompt.token_ids + c.token_ids for c in first], params)
    return [
        RolloutSample(
            a.token_ids + b.token_ids,
            a.logprobs + b.logprobs,
            "abort" if "abort" in (a.finish_reason, b.finish_reason) else b.finish_reason,
            version_start=a.version_start,
            version_end=b.version_end,
        )
        for a, [b] in zip(first, second, strict=True)
    ]


# Prompt ids `failing_rollout` raised for, in order (the test in this process reads it).
FAILED_CALLS: list[str] = []


async def failing_rollout(context: Any, prompt: Any) -> list[Any]:
    """The default rollout, except that it raises at once for prompt `train:0`."""
    from kuberl.rollout.functions import default_rollout

    if prompt.prompt_id == "train:0":
        FAILED_CALLS.append(prompt.prompt_id)
        raise RuntimeError("this rollout function fails for train:0")
    return await default_rollout(context, prompt)


async def misreported_rollout(context: Any, prompt: Any) -> list[Any]:
    """The default rollout, except that `train:0`'s samples end with a finish reason no
    trajectory has ("eos") and `train:1`'s carry metadata JSON cannot hold (a set)."""
    from kuberl.rollout.functions import default_rollout

    samples = await default_rollout(context, prompt)
    for sample in samples:
        if prompt.prompt_id == "train:0":
            sample.finish_reason = "eos"
        elif prompt.prompt_id == "train:1":
            sample.metadata = {"seen": {1, 2}}
    return samples


async def unversioned_rollout(context: Any, prompt: Any) -> list[Any]:
    """The default rollout's samples rebuilt without their policy versions, as a custom function
    that does not know about them would build them."""
    from kuberl.rollout.functions import RolloutSample, default_rollout

    return [
        RolloutSample(token_ids=s.token_ids, logprobs=s.logprobs, finish_reason=s.finish_reason)
        for s in await default_rollout(context, prompt)
    ]


class _Sample:
    def __init__(self, response: str) -> None:
        self.response = response


def test_parity_reward_is_one_for_odd_first_characters_and_zero_otherwise() -> None:
    assert [parity_reward(_Sample(r)) for r in ("a", "b", "")] == [1.0, 0.0, 0.0]
