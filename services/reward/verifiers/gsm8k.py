r"""The `gsm8k` verifier: the final number of a response against the dataset's answer.

The gold answer is the number after the last `####` of the dataset's `answer` column (GSM8K's
answers are whole worked solutions ending in `#### 72`); an answer without `####` is read as a
bare number ("72", "1,234.5"). A gold answer with no number is a verifier error, not a 0.

The model's answer is found by these rules, applied to the response with the prompt removed
wherever it is echoed verbatim, after LaTeX clean-up (`\frac{a}{b}`, `\dfrac` and `\tfrac` become
a/b, a mixed number `2\frac{1}{2}` becomes 5/2, `\text{...}` keeps its text, `{,}` is a
thousands comma, `\$`, `\%`, `\,` and `\!` are dropped):

1. Explicit markers. Every marker in the response is a candidate and the one that starts last
   wins (so a final answer beats an echoed few-shot example or an earlier attempt):
   - `#### <number>`: the number directly after `####` (up to 20 other characters such as
     `$`, `**`, `:` may come between, but no letter, digit or line break: a Markdown heading
     `#### Step 2` is not an answer);
   - `\boxed{...}` / `\fbox{...}`: the first number inside the braces;
   - `answer is / answer: / answer = / final answer ...` (any case): the number directly after;
   - a line starting with `A:` (possibly in bold): the number directly after.
   A marker with no number after it is not a candidate (`#### ` twice, the second empty, reads
   the first).
2. Otherwise the last number anywhere in the response (lm-eval's "flexible extract").
3. Otherwise there is no answer and the score is 0.
4. A hedged answer is no answer: when the number read is directly followed (for the last-number
   rule, preceded) by `,` or `or` and another number ("the answer is 70 or 72", "70, 71 or 72",
   `\boxed{18 \text{ or } 20}`), the score is 0 whichever of them is right.

A number is an optional minus sign (not one that follows a digit, letter or `)`: that is a
subtraction), digits with optional thousands commas (`1,234`), an optional decimal part, and an
optional `/denominator` (`3/4`). Currency symbols ($ € £ ¥) and trailing units, percent signs and
punctuation are ignored: `$1,234.50.`, `72 dollars`, `50%` read as 1234.5, 72 and 50. The Unicode
minus counts as a minus sign. Numbers written as words ("seventy-two") are not read.

The two numbers are compared exactly as rationals (72 == 72.0 == 144/2). The score is 1.0 when
they are equal, else 0.0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from kuberl.reward.sample import RewardSample
from kuberl.reward.verifiers import Verdict

_NUM = (
    r"(?:(?<![\w)])-)?"  # a minus sign that is not a subtraction
    r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+|(?=\.\d))"  # integer part, maybe with thousands commas
    r"(?:\.\d+)?"  # decimals
    r"(?:/\d+(?:\.\d+)?)?"  # a fraction's denominator
)
NUMBER = re.compile(_NUM)
_HASH = re.compile(r"####[^\w\n]{0,20}?(" + _NUM + ")")
_ANSWER = re.compile(
    r"(?i)\b(?:final\s+answer|answer)\b\s*(?:is|was|would\s+be|will\s+be|should\s+be|=|:)"
    r"[\s:=$*_`(\\\[]{0,12}?(" + _NUM + ")"
)
_A_LINE = re.compile(r"(?m)^[ \t]*(?:\*\*)?A(?:\*\*)?[ \t]*:[ \t]*(?:\*\*)?[ \t$]*(" + _NUM + ")")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_MIXED = re.compile(r"(?<![\d.])(\d+)\s*\\[dt]?frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}")
_PARENS_FRACTION = re.compile(r"\((-?\d+)\)/\((-?\d+)\)")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_CURRENCY = re.compile(r"[$€£¥]")
# A hedge: another number offered as an alternative right after (or, for the last number,
# right before) the one read, e.g. "70 or 72", "70, 71, 72", "70/72" would be a fraction.
_HEDGE_AFTER = re.compile(r"\s*(?:,|\bor\b)\s*(?:maybe\s+)?-?\.?\d")
_HEDGE_BEFORE = re.compile(r"\d\s*(?:,|\bor\b)\s*(?:maybe\s+)?-?$")


@dataclass(frozen=True)
class Extraction:
    """What was read from a response: the number (None when nothing was found) and how."""

    value: Fraction | None
    text: str
    rule: str  # "####", "boxed", "answer", "A:", "last number" or "none"


def parse_number(text: str) -> Fraction | None:
    """A number token as matched by NUMBER (commas, decimals, a/b) as an exact rational."""
    cleaned = text.replace(",", "")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def _clean(text: str) -> str:
    return _CURRENCY.sub("", text.replace("\u2212", "-"))


def _boxed_contents(text: str) -> list[tuple[int, str]]:
    """(start, content) of every \\boxed{...}, with nested braces balanced."""
    found = []
    for match in _BOXED.finditer(text):
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found.append((match.start(), text[match.end() : i - 1]))
    return found


def _fraction_text(numerator: str, denominator: str) -> str:
    if int(denominator) == 0:
        return f"{numerator}/{denominator}"
    value = Fraction(int(numerator), int(denominator))
    return str(value)  # "-1/2", or "3" for 6/2


def _latex_to_text(latex: str) -> str:
    text = latex.replace("{,}", ",").replace("\\$", "").replace("\\%", "%")
    # A mixed number: 2\frac{1}{2} is 5/2 (not 21/2).
    text = _MIXED.sub(
        lambda m: " " + _fraction_text(str(int(m[1]) * int(m[3]) + int(m[2])), m[3]), text
    )
    for _ in range(3):  # nested \frac / \text
        text = _FRAC.sub(r" (\1)/(\2)", text)
        text = _TEXT.sub(r" \1 ", text)
    text = _PARENS_FRACTION.sub(lambda m: _fraction_text(m[1], m[2]), text)
    return re.sub(r"\\[,!;: ]", "", text)


def extract_answer(response: str, prompt: str = "") -> Extraction:
    """The model's final number in `response` by the rules of this module's docstring."""
    text = _clean(_latex_to_text(response.replace(prompt, " ") if prompt.strip() else response))
    candidates: list[tuple[int, str, str, bool]] = []  # (start, number text, rule, hedged)
    for pattern, rule in ((_HASH, "####"), (_ANSWER, "answer"), (_A_LINE, "A:")):
        for m in pattern.finditer(text):
            if parse_number(m.group(1)) is not None:
                hedged = _HEDGE_AFTER.match(text, m.end()) is not None
                candidates.append((m.start(), m.group(1), rule, hedged))
    for start, content in _boxed_contents(text):
        inner = _clean(_latex_to_text(content))
        number = NUMBER.search(inner)
        if number and parse_number(number.group(0)) is not None:
            hedged = _HEDGE_AFTER.match(inner, number.end()) is not None
            candidates.append((start, number.group(0), "boxed", hedged))
    if candidates:
        _, number_text, rule, hedged = max(candidates)
        if hedged:
            return Extraction(None, number_text, f"{rule}, hedged")
        return Extraction(parse_number(number_text), number_text, rule)
    numbers = list(NUMBER.finditer(text))
    if numbers:
        last = numbers[-1]
        if _HEDGE_BEFORE.search(text, 0, last.start()):
            return Extraction(None, last.group(0), "last number, hedged")
        return Extraction(parse_number(last.group(0)), last.group(0), "last number")
    return Extraction(None, "", "none")


def gold_answer(answer: str) -> Fraction:
    """The reference number: after the last `####`, else the whole answer as one number."""
    tail = answer.rsplit("####", 1)[-1]
    match = NUMBER.search(_clean(tail))
    value = parse_number(match.group(0)) if match else None
    if value is None:
        raise ValueError(f"gold answer has no number after '####': {answer[-80:]!r}")
    return value


def score(sample: RewardSample) -> Verdict:
    """1.0 when the response's final number equals the gold number, else 0.0."""
    gold = gold_answer(sample.answer)
    got = extract_answer(sample.response, sample.prompt)
    correct = got.value is not None and got.value == gold
    note = f"read {got.text or 'nothing'} ({got.rule}); gold {gold}"
    return Verdict(1.0 if correct else 0.0, details=note)
