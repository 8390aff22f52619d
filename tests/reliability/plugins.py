"""The rollout function the network-partition test loads into its replica by `module:function`
path: the default rollout (one real engine call for the group), then a short sleep, so that the
replica always holds leases when the test cuts the link and uses little CPU on a shared box."""

from __future__ import annotations

import asyncio
from typing import Any

PACE_SECONDS = 0.3


async def paced_rollout(context: Any, prompt: Any) -> list[Any]:
    """`kuberl.rollout.functions.default_rollout`, then PACE_SECONDS of sleep."""
    from kuberl.rollout.functions import default_rollout

    samples = await default_rollout(context, prompt)
    await asyncio.sleep(PACE_SECONDS)
    return samples
