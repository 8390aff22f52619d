r"""The `format` and `regex` verifiers: does the response have the required shape?

`format` searches the response for the job's `reward.format_pattern` (default: a closed
`<think>...</think>` block at the very start followed by a non-empty answer, as in DeepSeek-R1's
format reward). `regex` searches it for the sample's own `metadata.regex` (for datasets whose rows
each say what a valid answer looks like). Both score 1.0 on a match and 0.0 otherwise, with
Python `re.search` semantics (anchor with `\A` / `\Z`). They run in the worker processes, so a
pattern that backtracks catastrophically on some response is cut off by the per-sample timeout.
"""

from __future__ import annotations

import functools
import re

from kuberl.reward.sample import RewardSample
from kuberl.reward.verifiers import Verdict


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def match_score(pattern: str, text: str) -> Verdict:
    """1.0 when `pattern` is found in `text`, else 0.0."""
    return Verdict(1.0 if _compiled(pattern).search(text) else 0.0)


def format_score(pattern: str, sample: RewardSample) -> Verdict:
    return match_score(pattern, sample.response)


def regex_score(sample: RewardSample) -> Verdict:
    pattern = sample.metadata.get("regex")
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("the regex verifier needs a non-empty string in metadata.regex")
    try:
        return match_score(pattern, sample.response)
    except re.error as exc:
        raise ValueError(f"metadata.regex is not a valid regex: {exc}") from None
