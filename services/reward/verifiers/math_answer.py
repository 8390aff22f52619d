r"""The `math` verifier: symbolic equivalence of final answers with the `math-verify` library.

Both the dataset answer and the response go through `math_verify.parse`, which finds the last
`\boxed{}` or LaTeX / plain expression and turns it into sympy (fractions, radicals, intervals,
sets, matrices, equations); `math_verify.verify` then decides equivalence (1/2 == 0.5 ==
\frac{1}{2}, [0,1) as an interval, {1,2} == {2,1}, (x+1)^2 == x^2+2x+1). A gold answer in
GSM8K style (`... #### 72`) is read after its last `####`. A gold answer that does not parse is a
verifier error; a response that does not parse scores 0.

math-verify bounds its own parsing and checking time with SIGALRM, so it runs in the worker
processes' main thread (the service's `pool` backend), never in a service thread.
"""

from __future__ import annotations

from typing import Any

from kuberl.reward.sample import RewardSample
from kuberl.reward.verifiers import Verdict


def _parse(text: str) -> list[Any]:
    from math_verify import parse

    return list(parse(text))


def gold_answer(answer: str) -> list[Any]:
    """The parsed reference answer; ValueError when math-verify finds nothing in it."""
    text = answer.rsplit("####", 1)[-1].strip() if "####" in answer else answer.strip()
    parsed = _parse(text)
    if not parsed and "$" not in text:
        parsed = _parse(f"${text}$")
    if not parsed:
        raise ValueError(f"math-verify cannot parse the gold answer {text[:80]!r}")
    return parsed


def score(sample: RewardSample) -> Verdict:
    """1.0 when the response's final answer is equivalent to the gold answer, else 0.0."""
    from math_verify import verify

    gold = gold_answer(sample.answer)
    predicted = _parse(sample.response)
    correct = bool(predicted) and bool(verify(gold, predicted))
    shown = str(predicted[-1]) if predicted else "nothing"
    return Verdict(1.0 if correct else 0.0, details=f"read {shown[:80]}; gold {gold[-1]}")
