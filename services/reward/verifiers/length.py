"""The `length` verifier: DAPO's overlong penalty ("soft overlong punishment").

With L the number of response tokens, S the soft limit and B the penalty buffer (DAPO's
L_max - L_cache and L_cache):

    penalty(L) = 0              if L <= S
               = (S - L) / B    if S < L <= S + B     (linear from 0 down to -1)
               = -1             if L > S + B

With B = 0 the penalty is a step: -1 as soon as L > S. S defaults to the rollout's
max_new_tokens - max(B, 1), so the penalty reaches -1 exactly at the generation budget: with the
default B = 0, a response cut at max_new_tokens gets -1 and any shorter one 0 (S was once
max_new_tokens itself, which no response exceeds, so the default penalised nothing). L is the
length of `response_token_ids`; a sample without token ids whose finish reason is "length" is
scored as if it had S + max(B, 1) tokens (cut at the budget); one with a non-empty response and
any other finish reason is an error, since its length cannot be known.
"""

from __future__ import annotations

from kuberl.reward.sample import RewardSample
from kuberl.reward.verifiers import Verdict


def default_soft_limit(max_new_tokens: int, buffer: int) -> int:
    """S when the job sets none: the penalty then reaches -1 at the generation budget."""
    return max(max_new_tokens - max(buffer, 1), 0)


def overlong_penalty(length: int, soft_limit: int, buffer: int) -> float:
    """DAPO's penalty for a response of `length` tokens, in [-1, 0]."""
    if length <= soft_limit:
        return 0.0
    if buffer == 0 or length > soft_limit + buffer:
        return -1.0
    return (soft_limit - length) / buffer


def score(sample: RewardSample, soft_limit: int, buffer: int) -> Verdict:
    length = len(sample.response_token_ids)
    if length == 0 and sample.finish_reason == "length":
        length = soft_limit + max(buffer, 1)
    elif length == 0 and sample.response:
        raise ValueError("the length verifier counts response_token_ids, and none were sent")
    return Verdict(overlong_penalty(length, soft_limit, buffer), extras={"tokens": float(length)})
