"""The gsm8k verifier: answer extraction from real model-style outputs, adversarial answers,
and every gold solution of the GSM8K test split (right as given, wrong with its final number
changed)."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from kuberl.reward.sample import RewardSample
from kuberl.reward.verifiers.gsm8k import extract_answer, gold_answer, score

GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")
GOLD_72 = "She sells 9 eggs at $8 each, 9 * 8 = <<9*8=72>>72.\n#### 72"


def _score(response: str, answer: str = GOLD_72, prompt: str = "") -> float:
    return score(RewardSample(prompt=prompt, response=response, answer=answer)).score


@pytest.mark.parametrize(
    "response",
    [
        "#### 72",
        "9 * 8 = 72 eggs' worth.\n#### 72",
        "The answer is 72.",
        "The answer is: **72**",
        "So the final answer is 72 dollars.",
        "Answer: $72",
        "A: 72",
        "**A:** 72",
        r"Therefore she makes $\boxed{72}$ dollars.",
        r"\boxed{\$72}",
        r"\boxed{72 \text{ dollars}}",
        r"The final answer is $\boxed{72}$.",
        "She makes 9 * 8 = $72 every day.",
        "72",
        "#### $72.00",
        "#### 72\n####",  # a trailing empty marker is not an answer
        # Markdown headings are not `####` answers (once "#### Step 2" read as 2).
        "#### Step 2: Multiply\n9 * 8 = 72\n\nSo she makes 72 dollars.",
        "#### Step 2: Multiply\n9 * 8 = 72\n#### Final Answer\n72",
    ],
)
def test_model_style_final_answers_of_72_are_read_as_72(response: str) -> None:
    assert _score(response) == 1.0


@pytest.mark.parametrize(
    ("response", "value"),
    [
        ("Total: $1,234.50.", Fraction("1234.5")),
        (r"\boxed{1{,}234.5}", Fraction("1234.5")),
        (r"\boxed{\frac{3}{4}}", Fraction(3, 4)),
        ("answer = 3/4", Fraction(3, 4)),
        ("The temperature falls to -3 degrees.", Fraction(-3)),
        ("The answer is \u22127.", Fraction(-7)),
        ("16 - 3 - 4 = 9", Fraction(9)),
        ("He keeps 50% of it, i.e. 50%.", Fraction(50)),
        ("x = .5", Fraction(1, 2)),
        # LaTeX outside a box, mixed numbers, signs (once 2, 21/2 and -1).
        (r"The answer is $\frac{1}{2}$", Fraction(1, 2)),
        (r"\boxed{2\frac{1}{2}}", Fraction(5, 2)),
        (r"\boxed{\frac{-1}{2}}", Fraction(-1, 2)),
        (r"\boxed{\dfrac{6}{2}} hours", Fraction(3)),
    ],
)
def test_numbers_are_read_with_commas_currency_fractions_signs_and_units(
    response: str, value: Fraction
) -> None:
    assert extract_answer(response).value == value


@pytest.mark.parametrize(
    ("name", "response"),
    [
        ("the last of two #### markers wins", "#### 72\nWait, no.\n#### 70"),
        ("a later 'answer is' beats an earlier boxed", r"\boxed{72}. Hmm, the answer is 70."),
        ("hedging between two numbers", "The answer is 70 or 72."),
        ("hedging in a list", "It could be 70, 71 or 72"),
        ("hedging inside a box", r"\boxed{72 \text{ or } 70}"),
        ("the gold number only in the reasoning", "First 72 / 2 = 36. The answer is 36."),
        ("no number at all", "I do not know."),
        ("the right digits of a bigger number", "The answer is 172."),
        ("the answer as a word", "The answer is seventy-two."),
    ],
)
def test_adversarial_answers_score_zero(name: str, response: str) -> None:
    assert _score(response) == 0.0, name


def test_a_response_that_only_echoes_the_question_scores_zero() -> None:
    prompt = "Sam has 5 apples and buys 67 more, then 5 are eaten and 5 bought: 72?"
    assert (_score(prompt, prompt=prompt), _score(prompt + " #### 72", prompt=prompt)) == (
        0.0,
        1.0,
    )


def test_an_echoed_few_shot_answer_loses_to_the_final_answer() -> None:
    response = "Q: 2+2? A: 4\n#### 4\nNow the real question. 9 * 8 = 72.\nThe answer is 72."
    assert _score(response) == 1.0


def test_the_gold_answer_is_the_number_after_the_last_marker_or_a_bare_number() -> None:
    assert [gold_answer(GOLD_72), gold_answer("1,234"), gold_answer("a #### b #### -5")] == [
        72,
        1234,
        -5,
    ]


def test_a_gold_answer_without_a_number_is_an_error_not_a_zero() -> None:
    with pytest.raises(ValueError, match="gold answer has no number"):
        _score("#### 72", answer="#### unknown")


def _gsm8k_test_split() -> list[dict[str, str]]:
    return [json.loads(line) for line in GSM8K_TEST.read_text().splitlines()]


def test_every_gsm8k_test_gold_solution_scores_one() -> None:
    rows = _gsm8k_test_split()
    wrong = [
        r["answer"][-40:]
        for r in rows
        if _score(r["answer"], answer=r["answer"], prompt=r["question"]) != 1.0
    ]
    assert (len(rows), wrong) == (1319, [])


def test_every_gsm8k_test_gold_solution_with_its_final_number_changed_scores_zero() -> None:
    rows = _gsm8k_test_split()
    right = []
    for r in rows:
        body, final = r["answer"].rsplit("####", 1)
        changed = f"{body}#### {int(final.strip().replace(',', '')) + 1}"
        if _score(changed, answer=r["answer"], prompt=r["question"]) != 0.0:
            right.append(changed[-40:])
    assert (len(rows), right) == (1319, [])
