"""Rollout functions: what turns one leased prompt into its group of samples.

A rollout function is called once per prompt as `await fn(context, prompt)` and returns the
group's `RolloutSample`s (exactly `context.group_size`, in sample order). `default_rollout`
samples them in one engine call; `kuberl.rollout.multiturn.multi_turn_rollout` runs tool calls;
a job can name its own as `rollout.rollout_function: "package.module:function"` (slime's
rollout-function path): it gets the engine, tokenizer and sampling parameters through the
`RolloutContext` and may do anything — several engine calls, external environments, custom
masking. The worker scores the samples, builds trajectories and puts the group, so a custom
function never touches the buffer or the reward service.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kuberl.common.config import JobConfig
from kuberl.common.plugins import PluginError, load_plugin
from kuberl.common.trajectory import FINISH_REASONS
from kuberl.rollout.engine.base import Completion, Engine, SamplingParams


@dataclass
class PromptItem:
    """A leased prompt as a rollout function sees it."""

    prompt_id: str
    epoch: int
    text: str
    answer: str
    token_ids: list[int]  # the prompt as the engine sees it (chat template applied if enabled)
    metadata: dict[str, Any] = field(default_factory=dict)
    kind: str = "train"  # train / eval: the stream it came from
    lease_id: str = ""
    delivery_count: int = 1


@dataclass
class RolloutSample:
    """One generated response of a group, as a rollout function returns it: tokens, the engine's
    logprobs, the loss mask and the policy versions; the worker turns it into a trajectory.

    A sample whose generation was aborted (weight update in `abort` mode, pause, shutdown) keeps
    finish_reason "abort": the worker then regenerates or releases the prompt, never trains on it.
    """

    token_ids: list[int]
    logprobs: list[float]  # engine logprob per token; any value where loss_mask is 0
    finish_reason: str = "stop"  # stop / length / abort / turn_limit
    loss_mask: list[int] | None = None  # None = train on every token
    # The policy versions the sample was generated with; None: the worker stamps the engine's
    # version from before and after the rollout function ran.
    version_start: int | None = None
    version_end: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    engine_queue_seconds: float = 0.0

    @classmethod
    def from_completion(cls, c: Completion) -> RolloutSample:
        return cls(
            token_ids=list(c.token_ids),
            logprobs=list(c.logprobs),
            finish_reason=c.finish_reason,
            version_start=c.version_start,
            version_end=c.version_end,
            engine_queue_seconds=c.engine_queue_seconds,
        )

    def check(self) -> None:
        """ValueError when the sample cannot become a trajectory (so that it fails its own group,
        not the batch around it)."""
        n = len(self.token_ids)
        if len(self.logprobs) != n or (self.loss_mask is not None and len(self.loss_mask) != n):
            raise ValueError(
                f"sample has {n} tokens, {len(self.logprobs)} logprobs and "
                f"{'no' if self.loss_mask is None else len(self.loss_mask)} loss-mask entries"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"sample finish_reason {self.finish_reason!r}; expected one of "
                f"{', '.join(FINISH_REASONS)}"
            )
        try:
            json.dumps(self.metadata)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"sample metadata must be JSON-serialisable: {exc}") from None


@dataclass
class RolloutContext:
    """Everything a rollout function may use."""

    engine: Engine
    tokenizer: Any
    sampling: SamplingParams  # n = group_size
    config: JobConfig
    tools: Any = None  # kuberl.rollout.tools.ToolRegistry when multi-turn is enabled

    @property
    def group_size(self) -> int:
        return self.sampling.n

    def encode(self, text: str) -> list[int]:
        """Token ids of text without special tokens (for appending to a context)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))


RolloutFn = Callable[[RolloutContext, PromptItem], Awaitable[list[RolloutSample]]]


async def default_rollout(ctx: RolloutContext, prompt: PromptItem) -> list[RolloutSample]:
    """n independent samples of one prompt, in one engine call."""
    [completions] = await ctx.engine.generate([prompt.token_ids], ctx.sampling)
    return [RolloutSample.from_completion(c) for c in completions]


def load_rollout_function(config: JobConfig) -> RolloutFn:
    """The job's rollout function: its own `module:function`, multi-turn, or the default."""
    spec = config.rollout.rollout_function
    if spec:
        fn = load_plugin(spec, kind="rollout function", params=["context", "prompt"])
        if not inspect.iscoroutinefunction(fn):
            raise PluginError(
                f"rollout function {spec!r}: must be `async def {getattr(fn, '__name__', 'fn')}"
                "(context, prompt)` (it awaits the engine)"
            )
        return fn
    if config.rollout.multi_turn.enabled:
        from kuberl.rollout.multiturn import multi_turn_rollout

        return multi_turn_rollout
    return default_rollout


def encode_prompt(
    tokenizer: Any,
    text: str,
    chat_template: bool,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt's token ids: the chat template with one user turn (and the tools' schemas,
    which the template renders, when given), or the plain text."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=True,
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer versions
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(text)["input_ids"]]


def prompt_metadata(metadata_json: str) -> dict[str, Any]:
    if not metadata_json:
        return {}
    try:
        value = json.loads(metadata_json)
    except json.JSONDecodeError:
        return {"raw": metadata_json}
    return value if isinstance(value, dict) else {"value": value}
