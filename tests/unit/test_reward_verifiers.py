"""The math, format, regex, length and code verifiers as plain functions, and the checks on
what any verifier may return."""

from __future__ import annotations

import math

import pytest

from kuberl.reward.sample import RewardSample
from kuberl.reward.verifiers import (
    Verdict,
    VerifierFailure,
    as_verdict,
    code,
    format,
    length,
    math_answer,
)

THINK = r"(?s)\A\s*<think>.*?</think>\s*\S"


def _math(response: str, answer: str) -> float:
    return math_answer.score(RewardSample(response=response, answer=answer)).score


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        (r"So $x = \boxed{\frac{1}{2}}$.", "0.5"),
        (r"\boxed{\dfrac12}", r"\frac{1}{2}"),
        (r"The solution set is $\boxed{[0, 1)}$", "[0,1)"),
        (r"$\boxed{\{2, 1\}}$", r"\{1,2\}"),
        (r"\boxed{(x+1)^2}", "x^2+2x+1"),
        (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
        ("Thus we get 18 in the end: \\boxed{18}", "Natalia sold ... #### 18"),
    ],
)
def test_math_accepts_equivalent_forms(response: str, answer: str) -> None:
    assert _math(response, answer) == 1.0


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        (r"\boxed{\frac{1}{3}}", "0.5"),
        (r"\boxed{[0, 1]}", "[0,1)"),
        (r"\boxed{\{1, 3\}}", r"\{1,2\}"),
        (r"\boxed{(x-1)^2}", "x^2+2x+1"),
        ("I have no idea", "3"),
    ],
)
def test_math_rejects_different_answers(response: str, answer: str) -> None:
    assert _math(response, answer) == 0.0


def test_math_gold_that_cannot_be_parsed_is_an_error() -> None:
    with pytest.raises(ValueError, match="cannot parse the gold answer"):
        _math(r"\boxed{1}", "")


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<think>2+2 is 4</think> The answer is 4.", 1.0),
        ("  <think>\nreasoning\n</think>\n4", 1.0),
        ("<think>never closed. The answer is 4.", 0.0),
        ("<think>reasoning</think>   ", 0.0),
        ("The answer is 4. <think>afterthought</think> 4", 0.0),
        ("", 0.0),
    ],
)
def test_format_requires_a_closed_think_block_first_then_an_answer(
    response: str, expected: float
) -> None:
    assert format.format_score(THINK, RewardSample(response=response)).score == expected


def test_regex_uses_the_samples_own_pattern() -> None:
    sample = RewardSample(response="Final: (B)", metadata={"regex": r"\(B\)\Z"})
    assert format.regex_score(sample).score == 1.0


@pytest.mark.parametrize("metadata", [{}, {"regex": ""}, {"regex": "("}])
def test_regex_without_a_valid_pattern_is_an_error(metadata: dict) -> None:
    with pytest.raises(ValueError, match=r"metadata\.regex"):
        format.regex_score(RewardSample(response="x", metadata=metadata))


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [(0, 0.0), (80, 0.0), (81, -0.05), (90, -0.5), (100, -1.0), (101, -1.0), (10_000, -1.0)],
)
def test_overlong_penalty_is_zero_then_linear_then_minus_one(tokens: int, expected: float) -> None:
    # soft limit 80, buffer 20: DAPO with L_max = 100, L_cache = 20.
    assert length.overlong_penalty(tokens, 80, 20) == pytest.approx(expected)


def test_overlong_penalty_without_a_buffer_is_a_step() -> None:
    assert [length.overlong_penalty(n, 80, 0) for n in (80, 81)] == [0.0, -1.0]


def test_length_counts_token_ids_and_reports_them() -> None:
    verdict = length.score(RewardSample(response="x", response_token_ids=[1] * 90), 80, 20)
    assert (verdict.score, verdict.extras) == (-0.5, {"tokens": 90.0})


def test_a_truncated_sample_without_token_ids_gets_the_full_penalty() -> None:
    sample = RewardSample(response="x", finish_reason="length")
    assert length.score(sample, 80, 20).score == -1.0


@pytest.mark.parametrize("tokens", [None, 256])
def test_with_the_default_settings_a_response_cut_at_the_budget_gets_minus_one(
    tokens: int | None,
) -> None:
    # Default job: no soft limit, no buffer, max_new_tokens 256. The soft limit was once 256,
    # which no response exceeds: the default penalised nothing.
    from kuberl.common.config import parse_job_config

    job = parse_job_config({"rollout": {"sampling": {"max_new_tokens": 256}}}, env={})
    soft = job.reward.length_soft_limit or length.default_soft_limit(
        job.rollout.sampling.max_new_tokens, job.reward.length_penalty_buffer
    )
    buffer = job.reward.length_penalty_buffer
    ids = [] if tokens is None else [1] * tokens
    cut = RewardSample(response="x", response_token_ids=ids, finish_reason="length")
    shorter = RewardSample(response="x", response_token_ids=[1] * 255, finish_reason="stop")
    assert [length.score(s, soft, buffer).score for s in (cut, shorter)] == [-1.0, 0.0]


def test_length_without_token_ids_for_a_finished_response_is_an_error() -> None:
    with pytest.raises(ValueError, match="response_token_ids"):
        length.score(RewardSample(response="some text", finish_reason="stop"), 80, 20)


@pytest.mark.parametrize(
    ("response", "program"),
    [
        ("Here:\n```python\nprint(1)\n```\nand better:\n```py\nprint(2)\n```", "print(2)\n"),
        ("```\nprint(3)\n```", "print(3)\n"),
        ("print(4)", "print(4)"),
        ("```cpp\nint main(){}\n```", ""),
        # Fences pair in order: a bash or text block's closing fence is not an opening one.
        ("```bash\nls\n```\nSolution:\n```python\nprint(5)\n```", "print(5)\n"),
        ("```text\n5\n```\n```python\nprint(6)\n```", "print(6)\n"),
        (
            "```python\nprint(0)\n```\n```output\n0\n```\nFinal:\n```python\nprint(7)\n```",
            "print(7)\n",
        ),
        ("```python\nprint(8)```", "print(8)"),
        ("Code:\n```Python3 \nprint(9)\n```\n", "print(9)\n"),
        ("```python\nprint(10)\n", ""),  # truncated: nothing to run
    ],
)
def test_the_program_is_the_last_python_fence_or_the_whole_response(
    response: str, program: str
) -> None:
    assert code.extract_code(response) == program


def test_tests_are_read_in_all_three_formats() -> None:
    io = [{"input": "1", "output": "2"}]
    assert [
        code.parse_tests({"tests": io}),
        code.parse_tests({"tests": {"inputs": ["1"], "outputs": ["2"]}}),
        code.parse_tests({"tests": ["assert f(1) == 2", {"assert": "assert f(2) == 3"}]}),
    ] == [io, io, [{"assert": "assert f(1) == 2"}, {"assert": "assert f(2) == 3"}]]


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({}, "needs metadata.tests"),
        ({"tests": []}, "non-empty list"),
        ({"tests": {"inputs": ["1"], "outputs": []}}, "1 inputs, 0 outputs"),
        ({"tests": [{"input": 1, "output": "2"}]}, r"tests\[0\] must be"),
        ({"tests": [3]}, r"tests\[0\] must be a string or an object"),
    ],
)
def test_malformed_tests_are_explained(metadata: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        code.parse_tests(metadata)


def test_the_code_reward_is_the_fraction_of_tests_passed() -> None:
    results = [
        {"status": "passed", "detail": ""},
        {"status": "timeout", "detail": "still running"},
        {"status": "passed", "detail": ""},
        {"status": "wrong_answer", "detail": "expected '3'"},
    ]
    verdict = code.verdict(results)
    assert (verdict.score, verdict.extras) == (
        0.5,
        {"passed": 2.0, "total": 4.0, "timeout": 1.0, "wrong_answer": 1.0},
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, 1.0), (True, 1.0), (0.25, 0.25), (Verdict(0.5, {"x": 1.0}), 0.5)],
)
def test_numbers_bools_and_verdicts_are_valid_scores(value: object, expected: float) -> None:
    assert as_verdict(value, "v").score == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (math.nan, "non_finite"),
        (math.inf, "non_finite"),
        ("1.0", "bad_return"),
        (None, "bad_return"),
        (Verdict(1.0, {"x": math.nan}), "non_finite"),
        (Verdict(1.0, {"x": "high"}), "bad_return"),  # type: ignore[dict-item]
    ],
)
def test_nan_infinity_and_non_numbers_are_refused(value: object, reason: str) -> None:
    with pytest.raises(VerifierFailure) as err:
        as_verdict(value, "v")
    assert err.value.reason == reason


def test_numpy_scores_and_extras_become_plain_floats_a_worker_can_send() -> None:
    # np.float32 extras once crashed the worker's json.dumps (reported as worker_died).
    import json

    import numpy as np

    verdict = as_verdict(Verdict(np.float32(1.0), {"x": np.float32(0.5), "n": np.int64(3)}), "v")
    assert json.dumps([verdict.score, verdict.extras]) == '[1.0, {"x": 0.5, "n": 3.0}]'
