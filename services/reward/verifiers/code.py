r"""The `code` verifier: which of the sample's tests the response's program passes.

The program is the last fenced code block of the response labelled `python`, `py`, `python3`
or not labelled at all (```` ```python ... ``` ````); a response without a fence is taken whole.
It runs in `kuberl.common.sandbox` (Python 3 standard library; see there for the isolation) and
the reward is the fraction of tests passed. A program that loops, exhausts memory, forks without
end, writes too much or crashes simply fails the test concerned; only a sandbox that cannot run
at all is a verifier error.

Tests come from the sample's metadata, key `tests`, in one of these forms:

- a list of stdin/stdout cases, `[{"input": "1 2\n", "output": "3\n"}, ...]`: the program reads
  `input` on stdin; it passes when it exits with status 0 and its stdout equals `output` line by
  line after trailing whitespace is removed from each line and trailing empty lines are dropped;
- the same as two lists, `{"inputs": [...], "outputs": [...]}` (APPS / TACO `input_output`);
- a list of assert statements, `["assert add(1, 2) == 3", ...]` or `[{"assert": "..."}]`
  (MBPP / HumanEval style): the program is executed as a module (not as `__main__`, so its
  `if __name__ == "__main__":` block does not run, and stdin is empty), then the statement; it
  passes when neither raises.

Stdin/stdout cases are judged outside the program, so the program cannot forge a pass. Assert
tests run inside the program's own interpreter: a program written to subvert that harness (for
example, returning an object whose `__eq__` is always true) can pass them, as with every
in-process harness; prefer stdin/stdout tests where reward hacking matters.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from kuberl.reward.verifiers import Verdict

#: An opening fence: three or more backticks and an optional label ending the line.
_OPEN = re.compile(r"```[ \t]*([\w.+-]*)[ \t]*$")
_PYTHON = {"", "python", "python3", "py"}


def fenced_blocks(response: str) -> list[tuple[str, str]]:
    """(label, body) of every closed fenced block, fences paired in order line by line.

    A fence that opens a block is a line ending in ``` plus an optional label; the next line
    ending in ``` closes it (whatever precedes the backticks on that line is the block's last
    line). Pairing in order keeps the closing fence of a `bash` block from being read as the
    opening of an unlabelled one. A block left open (a truncated response) is not a block.
    """
    blocks: list[tuple[str, str]] = []
    label: str | None = None
    body: list[str] = []
    for line in response.split("\n"):
        if label is None:
            opening = _OPEN.search(line)
            if opening:
                label, body = opening.group(1).lower(), []
            continue
        stripped = line.rstrip()
        if stripped.endswith("```"):
            body.append(stripped[:-3])
            blocks.append((label, "\n".join(body)))
            label = None
        else:
            body.append(line)
    return blocks


def extract_code(response: str) -> str:
    """The last python (or unlabelled) fenced block; "" when there are fences but no such closed
    block (nothing to run); the whole response when it has no fence at all."""
    python = [body for label, body in fenced_blocks(response) if label in _PYTHON]
    if python:
        return python[-1]
    return "" if "```" in response else response


def parse_tests(metadata: dict[str, Any]) -> list[dict[str, str]]:
    """The sample's tests as launcher test dicts; ValueError says what is wrong with them."""
    tests = metadata.get("tests")
    if tests is None:
        raise ValueError("the code verifier needs metadata.tests (see docs/reward.md)")
    if isinstance(tests, dict):
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ValueError("metadata.tests as an object needs lists 'inputs' and 'outputs'")
        if len(inputs) != len(outputs):
            raise ValueError(f"metadata.tests has {len(inputs)} inputs, {len(outputs)} outputs")
        tests = [{"input": i, "output": o} for i, o in zip(inputs, outputs, strict=True)]
    if not isinstance(tests, list) or not tests:
        raise ValueError("metadata.tests must be a non-empty list")
    parsed = []
    for i, test in enumerate(tests):
        if isinstance(test, str):
            test = {"assert": test}
        if not isinstance(test, dict):
            raise ValueError(f"metadata.tests[{i}] must be a string or an object")
        if isinstance(test.get("assert"), str):
            parsed.append({"assert": test["assert"]})
        elif isinstance(test.get("input"), str) and isinstance(test.get("output"), str):
            parsed.append({"input": test["input"], "output": test["output"]})
        else:
            raise ValueError(
                f"metadata.tests[{i}] must be {{'input': str, 'output': str}} or "
                f"{{'assert': str}} (got keys {sorted(test)})"
            )
    return parsed


def verdict(results: list[dict[str, str]]) -> Verdict:
    """Fraction of tests passed, with counts per outcome and the first failures explained."""
    statuses = Counter(r["status"] for r in results)
    passed = statuses.get("passed", 0)
    extras = {"passed": float(passed), "total": float(len(results))}
    extras.update({status: float(n) for status, n in statuses.items() if status != "passed"})
    failures = [
        f"test {i}: {r['status']}" + (f" ({r['detail']})" if r.get("detail") else "")
        for i, r in enumerate(results)
        if r["status"] != "passed"
    ]
    details = f"{passed}/{len(results)} passed" + (
        "; " + "; ".join(failures[:5]) if failures else ""
    )
    return Verdict(passed / len(results), extras=extras, details=details)
