"""The built-in verifiers and the small vocabulary they share.

A verifier turns one `RewardSample` into a score. Pure-Python verifiers are plain functions
`(sample) -> float | Verdict`; where each one runs is its `backend`:

- `pool`: CPU-bound, run in the service's worker processes (a hang is cut off by killing the
  worker): gsm8k, math, format, regex, and custom synchronous functions;
- `inline`: arithmetic on the sample, computed in the service itself: length;
- `sandbox`: code execution in `kuberl.common.sandbox`: code;
- `model`: the batched reward model: rm;
- `async`: custom `async def` functions, awaited on the service's event loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

Backend = Literal["pool", "inline", "sandbox", "model", "async"]


@dataclass(frozen=True)
class Verdict:
    """A verifier's score with optional extra numbers and a human-readable note.

    `extras` appear in the sample's breakdown as "<verifier>/<key>" (e.g. "code/passed");
    `details` is shown to people (the CLI, the gRPC `details` field), never used for training.
    """

    score: float
    extras: dict[str, float] = field(default_factory=dict)
    details: str = ""


class VerifierFailure(Exception):
    """A verifier could not score a sample; the sample gets the fallback reward.

    `reason` is a short label counted in metrics (timeout, exception, non_finite, bad_return,
    worker_died, sandbox); the message says what happened.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class BuiltinVerifier:
    name: str
    backend: Backend
    description: str


BUILTINS: dict[str, BuiltinVerifier] = {
    v.name: v
    for v in (
        BuiltinVerifier(
            "gsm8k",
            "pool",
            "Final number of the response (####, \\boxed{}, 'answer is', last number) equals "
            "the number after #### in the dataset answer: 1 or 0.",
        ),
        BuiltinVerifier(
            "math",
            "pool",
            "Symbolic equivalence of the response's final answer with the dataset answer "
            "(math-verify: LaTeX, fractions, intervals, sets): 1 or 0.",
        ),
        BuiltinVerifier(
            "code",
            "sandbox",
            "Runs the response's code against metadata.tests in a sandbox: fraction of tests "
            "passed.",
        ),
        BuiltinVerifier(
            "format", "pool", "1 if the response matches the job's format_pattern, else 0."
        ),
        BuiltinVerifier(
            "regex", "pool", "1 if the response matches the sample's metadata.regex, else 0."
        ),
        BuiltinVerifier(
            "length",
            "inline",
            "DAPO overlong penalty: 0 up to the soft limit, then linear down to -1 over the "
            "penalty buffer (counts response_token_ids).",
        ),
        BuiltinVerifier(
            "rm", "model", "Score of the job's sequence-classification reward model (a logit)."
        ),
    )
}


def as_verdict(value: object, what: str) -> Verdict:
    """Check a verifier's return value: a finite number (bool and int count) or a Verdict."""
    score = value.score if isinstance(value, Verdict) else value
    checked = _finite(score, what, value)
    if isinstance(value, Verdict):
        # Plain floats: numpy scalars in the extras once crashed the worker's json.dumps.
        extras = {str(k): _finite(v, f"{what} extra {k!r}", v) for k, v in value.extras.items()}
        return Verdict(checked, extras, str(value.details))
    return Verdict(checked)


def _finite(number: object, what: str, returned: object) -> float:
    """`number` as a finite plain float; VerifierFailure when it is not a number or not finite."""
    if isinstance(number, bool):
        number = float(number)
    if not isinstance(number, int | float):
        # numpy scalars and 0-d tensors have __float__; strings are refused, not parsed.
        try:
            if isinstance(number, str | bytes) or not hasattr(number, "__float__"):
                raise TypeError
            number = float(number)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise VerifierFailure(
                "bad_return", f"{what} returned {type(returned).__name__}, expected a number"
            ) from None
    number = float(number)
    if not math.isfinite(number):
        raise VerifierFailure("non_finite", f"{what} returned {number}")
    return number
