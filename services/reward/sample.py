"""The sample a verifier scores, as every verifier (built-in or custom) receives it.

The gRPC servicer and the CLI build `RewardSample`s from their input; the worker processes get
them as JSON (`to_json` / `from_json`), never pickled. Custom reward functions receive exactly
this object, so its fields are a public interface: add, never rename.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FINISH_REASONS = ("", "stop", "length", "abort", "turn_limit")


@dataclass(frozen=True)
class RewardSample:
    """One finished response to score.

    `answer` is the dataset's reference answer; `metadata` the dataset's other columns (e.g.
    `tests` for the code verifier); `response_token_ids` may be empty when the caller sent none;
    `finish_reason` is one of "", "stop", "length", "abort", "turn_limit".
    """

    sample_id: str = ""
    prompt: str = ""
    response: str = ""
    answer: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    response_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""

    def to_json(self, with_tokens: bool = True) -> dict[str, Any]:
        return {
            "sample_id": self.sample_id,
            "prompt": self.prompt,
            "response": self.response,
            "answer": self.answer,
            "metadata": self.metadata,
            "response_token_ids": self.response_token_ids if with_tokens else [],
            "finish_reason": self.finish_reason,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RewardSample:
        """Build from a JSON object (unknown keys are errors, missing ones take defaults)."""
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown sample fields {sorted(unknown)}; expected some of "
                f"{', '.join(cls.__dataclass_fields__)}"
            )
        for key in ("sample_id", "prompt", "response", "answer", "finish_reason"):
            if key in data and not isinstance(data[key], str):
                raise ValueError(f"sample field {key!r} must be a string")
        metadata = data.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ValueError("sample field 'metadata' must be a JSON object")
        tokens = data.get("response_token_ids") or []
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise ValueError("sample field 'response_token_ids' must be a list of integers")
        if data.get("finish_reason", "") not in FINISH_REASONS:
            raise ValueError(
                f"finish_reason {data['finish_reason']!r}; expected one of {FINISH_REASONS}"
            )
        return cls(**{**data, "metadata": metadata, "response_token_ids": tokens})
