r"""The `format` and `regex` verifiers: does the response have the required shape?

`format` searches the response for the job's `reward.format_pattern` (default: a closed
`<think>...</think>` block at the very start followed by a non-empty answer, as in DeepSeek-R1's
format reward). `regex` searches it for the sample's own `metadata.regex` (for datasets whose rows
each say what a valid answer looks like). Both score 1.0 on a match and 0.0 otherwise, with
`re.search` semantics (anchor with `\A` / `\Z`). Patterns run on RE2 (google-re2), whose matching
time is linear in the response: a sample's pattern must be RE2 syntax (no backreferences or
lookaround), so no sample can hold a worker with catastrophic backtracking. The job's own
format pattern, trusted configuration, falls back to Python's `re` (cut off by the per-sample
timeout) when RE2 cannot compile it.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import re2

from kuberl.reward.sample import RewardSample
from kuberl.reward.verifiers import Verdict

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is the sample's error, not a log line
# Python's `\Z` (end of text) is RE2's `\z`; an escaped backslash before a Z is left alone.
_END_OF_TEXT = re.compile(r"(?<!\\)((?:\\\\)*)\\Z")


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str, linear_only: bool = False) -> Any:
    """`pattern` compiled on RE2; with `linear_only` a pattern RE2 refuses is a ValueError, else
    it is compiled with Python's `re`."""
    try:
        return re2.compile(_END_OF_TEXT.sub(r"\1\\z", pattern), _RE2_OPTIONS)
    except re2.error as exc:
        if linear_only:
            detail = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
            raise ValueError(
                f"metadata.regex is not a valid RE2 pattern ({detail}): a sample's pattern must "
                "match in linear time (no backreferences or lookaround)"
            ) from None
    return re.compile(pattern)


def match_score(pattern: str, text: str, *, linear_only: bool = False) -> Verdict:
    """1.0 when `pattern` is found in `text`, else 0.0."""
    return Verdict(1.0 if _compiled(pattern, linear_only).search(text) else 0.0)


def format_score(pattern: str, sample: RewardSample) -> Verdict:
    return match_score(pattern, sample.response)


def regex_score(sample: RewardSample) -> Verdict:
    pattern = sample.metadata.get("regex")
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("the regex verifier needs a non-empty string in metadata.regex")
    return match_score(pattern, sample.response, linear_only=True)
