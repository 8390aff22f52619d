"""The `reward` section: verifiers, custom verifiers and the reward model."""

from __future__ import annotations

import math
import re

from pydantic import Field, model_validator

from kuberl.common.config.base import Section, ServerConfig, server_field
from kuberl.common.config.sandbox import SandboxConfig


class VerifierSpec(Section):
    """A custom verifier loaded from a dotted path (`kuberl.reward.verifiers.custom`).

    The function is called as `function(sample)` with a `kuberl.reward.sample.RewardSample` and
    returns a number (bool and int count). A plain function runs in the reward service's worker
    processes, so a hang is cut off by killing the worker; an `async def` runs on the service's
    event loop (for I/O such as calling a judge model) and is cancelled at the timeout."""

    function: str = Field(description="module:function taking (sample) and returning a float.")
    description: str = ""


class RewardModelConfig(Section):
    """A sequence-classification reward model (`kuberl.reward.verifiers.reward_model`)."""

    path: str = Field(
        description="Local HF sequence-classification model folder, or a hub id fetched once "
        "into the HF cache."
    )
    revision: str | None = Field(None, description="Branch, tag or commit of a hub id.")
    batch_size: int = Field(16, ge=1)
    device: str = "cpu"
    max_length: int = Field(
        4096, ge=8, description="Prompt + response tokens kept (the left end is cut)."
    )
    chat_template: bool = Field(
        True,
        description="Format (prompt, response) as a user/assistant chat with the tokenizer's "
        "template when it has one; else the two texts are concatenated.",
    )


#: Verifiers built into the reward service; `custom` names must differ from these.
BUILTIN_VERIFIERS = ("gsm8k", "math", "code", "format", "regex", "length", "rm")


class RewardConfig(Section):
    """The reward service (`kuberl.reward`): which verifiers score a sample and how.

    The reward of a sample is sum(weight * score) over `verifiers` (or over the sample's own
    `verifiers` list, see docs/reward.md); a verifier that raises, hangs past `timeout_seconds`
    or returns NaN makes the sample's reward `fallback_reward` with the reason in its error."""

    server: ServerConfig = server_field(50052, 9102)
    verifiers: dict[str, float] = Field(
        default_factory=lambda: {"gsm8k": 1.0},
        description="Verifier name -> weight; the reward is the weighted sum of their scores. "
        "Names: gsm8k, math, code, format, regex, length, rm, or a key of `custom`.",
    )
    custom: dict[str, VerifierSpec] = Field(
        default_factory=dict, description="Extra verifiers by name, usable in `verifiers`."
    )
    timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="Per-sample scoring timeout of each backend (the worker-process verifiers "
        "of a sample together, one code run, one reward-model batch, one async custom call).",
    )
    fallback_reward: float = Field(
        0.0, description="Reward of a sample whose verifier raised, hung or returned NaN."
    )
    workers: int = Field(2, ge=1, description="Processes scoring CPU-bound verifiers.")
    length_soft_limit: int = Field(
        0,
        ge=0,
        description="DAPO overlong penalty starts here (0 = max_new_tokens - buffer, or "
        "max_new_tokens - 1 with no buffer: a response cut at the budget gets -1).",
    )
    length_penalty_buffer: int = Field(
        0, ge=0, description="Tokens over which the penalty grows linearly from 0 to -1."
    )
    format_pattern: str = Field(
        r"(?s)\A\s*<think>.*?</think>\s*\S",
        description="Regex the `format` verifier searches for (re.search; anchor it with \\A "
        "to require it at the start). The default requires a closed <think> block first, then "
        "a non-empty answer.",
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    reward_model: RewardModelConfig | None = None

    @model_validator(mode="after")
    def _known_verifiers(self) -> RewardConfig:
        shadowing = sorted(set(self.custom) & set(BUILTIN_VERIFIERS))
        if shadowing:
            raise ValueError(f"custom verifiers may not reuse built-in names: {shadowing}")
        known = (*BUILTIN_VERIFIERS, *self.custom)
        for name, weight in self.verifiers.items():
            if name not in known:
                raise ValueError(
                    f"verifiers: unknown verifier {name!r}; expected one of {', '.join(known)}"
                )
            if not math.isfinite(weight):
                raise ValueError(f"verifiers: weight of {name!r} must be finite (got {weight})")
        if "rm" in self.verifiers and self.reward_model is None:
            raise ValueError("verifiers: 'rm' needs a reward_model section (path of the model)")
        try:
            re.compile(self.format_pattern)
        except re.error as exc:
            raise ValueError(f"format_pattern is not a valid regex: {exc}") from None
        return self
