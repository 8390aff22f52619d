"""Custom verifiers: any `module:function` named in the job's `reward.custom` (slime-style).

The function is called as `function(sample)` with a `kuberl.reward.sample.RewardSample` and
returns a number or a `kuberl.reward.verifiers.Verdict`. A plain function runs in the worker
processes (it may block or burn CPU; a hang is cut off by killing the worker). An `async def`
function runs on the service's event loop, for I/O-bound checks such as asking a judge model; it
is cancelled at the timeout, so it must not block the loop (no `time.sleep`, no CPU-heavy work).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from kuberl.common.config import VerifierSpec
from kuberl.common.plugins import load_plugin


def load(name: str, spec: VerifierSpec) -> Callable[..., Any]:
    """Import the function; PluginError says what is wrong with the spec."""
    return load_plugin(spec.function, kind=f"reward.custom.{name}", params=["sample"])


def is_async(fn: Callable[..., Any]) -> bool:
    """True for `async def` functions (and callables whose `__call__` is one)."""
    call = type(fn).__call__ if not inspect.isroutine(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)
