"""The `simulated` engine: the engine interface without a model, for scale benchmarks.

It draws each sample's response length from a log-normal around `response_tokens` (capped by
`max_new_tokens`), random token ids below `vocab_size` and logprobs `-Exp(1)` (always <= 0), and
takes as long as a real engine decoding every sequence in parallel at `tokens_per_second` would:
a batch ends when its longest sample does. Nothing else is simulated: pause (in place or
aborting), resume, abort and weight loads behave as the interface says, and the loaded version is
stamped on every completion, so a rollout replica, the buffer, the reward service and weight-sync
run for real around it. Hundreds of these fit in one process (a sleeping coroutine each).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kuberl.common.config import SimulatedEngineConfig
from kuberl.rollout.engine.base import (
    Completion,
    Engine,
    EngineRejected,
    EngineStatus,
    NamedTensors,
    PauseMode,
    SamplingParams,
)

#: Generation advances in steps of at most this long, so pause and abort act within one step.
STEP_SECONDS = 0.05


@dataclass(eq=False)
class _Request:
    rid: str
    aborted: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


class SimulatedEngine(Engine):
    """Tokens at a set rate and length distribution, no model (see the module docstring)."""

    kind = "simulated"

    def __init__(self, config: SimulatedEngineConfig, seed: int = 0) -> None:
        """`seed` is the replica's own (`replica_seed`): replicas that drew the same lengths
        would finish every batch together and call the buffer in waves."""
        self.config = config
        self._rng = np.random.default_rng(seed)
        self._version = 0
        self._paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._running: set[_Request] = set()
        self._ids = itertools.count()
        self.loads = 0  # weight loads taken, for tests and benchmarks

    @property
    def version(self) -> int:
        return self._version

    def lengths(self, count: int, max_new_tokens: int) -> np.ndarray:
        """`count` response lengths: log-normal around `response_tokens`, in [1, max_new]."""
        c = self.config
        drawn = c.response_tokens * np.exp(c.length_sigma * self._rng.standard_normal(count))
        return np.clip(np.rint(drawn), 1, max_new_tokens).astype(np.int64)

    async def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        if not prompts:
            return []
        await self._resumed.wait()
        request = _Request(rid=f"sim-{next(self._ids)}")
        lengths = self.lengths(len(prompts) * params.n, params.max_new_tokens)
        version_start = self._version
        self._running.add(request)
        try:
            produced = await self._decode(request, int(lengths.max()))
        finally:
            self._running.discard(request)
        out: list[list[Completion]] = []
        for i in range(len(prompts)):
            row = []
            for s in range(params.n):
                want = int(lengths[i * params.n + s])
                got = min(want, produced)
                if got < want:
                    reason = "abort"
                else:
                    reason = "length" if want == params.max_new_tokens else "stop"
                row.append(
                    Completion(
                        token_ids=self._rng.integers(0, self.config.vocab_size, got).tolist(),
                        logprobs=(-self._rng.exponential(1.0, got)).tolist(),
                        finish_reason=reason,  # type: ignore[arg-type]
                        version_start=version_start,
                        version_end=self._version,
                        rid=f"{request.rid}-{i}-{s}",
                    )
                )
            out.append(row)
        return out

    async def _decode(self, request: _Request, tokens: int) -> int:
        """Sleep as long as decoding `tokens` takes (paused time excluded); tokens produced."""
        rate = self.config.tokens_per_second
        produced = 0.0
        while produced < tokens and not request.aborted:
            if self._paused:
                await self._resumed.wait()
                continue
            step = min(STEP_SECONDS, (tokens - produced) / rate)
            await asyncio.sleep(step)
            if not request.aborted and not self._paused:
                produced += step * rate
        return tokens if produced >= tokens else int(produced)

    async def pause(self, mode: PauseMode = "in_place") -> int:
        if mode not in ("abort", "in_place"):
            raise ValueError(f"pause mode must be 'abort' or 'in_place', got {mode!r}")
        self._paused = True
        self._resumed.clear()
        return await self.abort_all() if mode == "abort" else 0

    async def resume(self) -> None:
        self._paused = False
        self._resumed.set()

    async def abort_all(self) -> int:
        running = [r for r in self._running if not r.aborted]
        for r in running:
            r.aborted = True
        return len(running)

    async def health(self) -> bool:
        return True

    async def status(self) -> EngineStatus:
        return EngineStatus(self.kind, self._version, self._paused, len(self._running), 0)

    async def load_weights(
        self, named_tensors: NamedTensors, version: int, *, borrow: bool = False
    ) -> int:
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        count = sum(1 for _ in items)
        self._take(version)
        return count

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        if not any(Path(path).glob("*.safetensors")):
            raise EngineRejected(f"no *.safetensors file in {path}")
        self._take(version)

    def _take(self, version: int) -> None:
        if version < self._version:
            raise EngineRejected(
                f"weights of version {version} are older than the loaded version {self._version}"
            )
        self._version = version
        self.loads += 1
