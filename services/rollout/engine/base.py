"""The engine interface every rollout engine implements, and the types that cross it.

The rollout loop (`kuberl.rollout.worker`) and rollout functions talk to an engine only through
`Engine`: generate `n` samples for each of a batch of token-id prompts with `SamplingParams` and get
back per-sample `Completion`s; pause / resume / abort; load new weights (a dict of tensors, a
safetensors folder, a broadcast group, CUDA IPC handles); report the loaded version and health. Two
engines implement it: `torch` (an in-process HF transformers model) and `sglang` (a client of an
SGLang server's native HTTP API).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from kuberl.common.config import SamplingConfig

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "in_place"]


class EngineError(Exception):
    """An engine call failed; the message says what was asked and what went wrong."""


class EngineUnavailable(EngineError):
    """The engine cannot be reached or is not ready (retrying later may succeed)."""


class EngineTimeout(EngineError):
    """The engine did not answer within its deadline."""


class EngineRejected(EngineError):
    """The engine refused the request as invalid (retrying the same request will not help)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's responses. `n` samples are drawn for every prompt."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        problems = []
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    @classmethod
    def from_config(cls, config: SamplingConfig, n: int = 1, **overrides: Any) -> SamplingParams:
        values: dict[str, Any] = {
            "temperature": config.temperature,
            "top_p": config.top_p,
            "top_k": config.top_k,
            "max_new_tokens": config.max_new_tokens,
            "stop": tuple(config.stop),
            "stop_token_ids": tuple(config.stop_token_ids),
            "ignore_eos": config.ignore_eos,
            "n": n,
        }
        values.update(overrides)
        return cls(**values)

    def with_(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)


@dataclass
class Completion:
    """One sampled response: what the engine produced and under which weights.

    A logprob is taken from `log_softmax(logits / temperature)` over the whole vocabulary,
    before top-k / top-p truncation (`log_softmax(logits)` when greedy): SGLang's default, and
    what trainers recompute.
    """

    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token, same length as token_ids
    finish_reason: FinishReason
    version_start: int  # policy version loaded when generation of this sample started
    version_end: int  # ... and when it ended (differs if weights changed mid-generation)
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it
    rid: str = ""
    engine_queue_seconds: float = 0.0  # waited inside the engine before generation started

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise EngineError(
                f"completion {self.rid!r}: {len(self.token_ids)} tokens but "
                f"{len(self.logprobs)} logprobs"
            )


@dataclass
class EngineStatus:
    kind: str
    version: int
    paused: bool
    running_requests: int
    queued_requests: int
    extra: dict[str, Any] = field(default_factory=dict)


NamedTensors = Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]


class Engine(abc.ABC):
    """A generation engine with logprobs, pausing and weight updates. All methods are async
    and safe to call from one asyncio loop; `generate` may be called concurrently."""

    kind: str = "engine"

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The policy version of the loaded weights (0 = the initial model)."""

    async def start(self) -> None:
        """Get ready (load the model / wait for the server). Idempotent."""
        return None

    async def close(self) -> None:
        """Abort what is running and release resources."""
        return None

    @abc.abstractmethod
    async def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """`params.n` completions for each prompt, as [prompt][sample]. Aborted samples come
        back with finish_reason "abort" (and whatever tokens they had), never as an error."""

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = "in_place") -> int:
        """Stop generating. "abort" aborts every running and queued request (they return with
        finish_reason "abort"); "in_place" keeps them and continues after `resume`. Returns
        the number of requests aborted. Returns once no forward step is running."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue after `pause`."""

    @abc.abstractmethod
    async def abort_all(self) -> int:
        """Abort every running and queued request without pausing; returns how many."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the engine can generate."""

    async def flush_cache(self) -> None:
        """Drop any prefix / KV cache computed with the previous weights."""
        return None

    @abc.abstractmethod
    async def status(self) -> EngineStatus: ...

    # -- weight updates ------------------------------------------------------------------------

    async def load_weights(
        self, named_tensors: NamedTensors, version: int, *, borrow: bool = False
    ) -> int:
        """Load tensors held by this process (names as in the HF state dict); returns how many
        were loaded. Only engines living in this process support it. `borrow`: the tensors stay
        valid and unchanged until the next load (the weight-sync `EngineClient`'s contract), so
        the engine may serve from them instead of copying them."""
        raise NotImplementedError(f"the {self.kind} engine cannot load in-process tensors")

    @abc.abstractmethod
    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load a safetensors snapshot (an HF model folder) written at `path`."""

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Join a torch.distributed group in which the trainer (rank 0) broadcasts weights."""
        raise NotImplementedError(f"the {self.kind} engine does not join broadcast groups")

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        version: int,
        group_name: str = "weight_update_group",
    ) -> None:
        """Receive the named tensors broadcast by rank 0 of the group, in order, and load them."""
        raise NotImplementedError(f"the {self.kind} engine does not receive broadcasts")

    async def update_weights_from_tensor(
        self, serialized_named_tensors: Sequence[str], version: int, load_format: str | None = None
    ) -> None:
        """Load tensors shared through CUDA IPC (colocated trainer): one payload per
        tensor-parallel rank in SGLang's own format, base64 (`kuberl.common.weights.sglang`
        makes them from weight-sync's CUDA IPC handles), passed through opaquely."""
        raise NotImplementedError(f"the {self.kind} engine does not load CUDA IPC handles")
