"""The demo's task: two-number addition questions with a verifiable answer, generated from a seed.

`make demo` (examples/demo.yaml) trains a ~0.8M-parameter Qwen2-architecture model with a character
tokenizer, built locally, to answer "Q: 23+17=\nA: " with "40", checked by the reward service's
`gsm8k` verifier (the response's last number equals the answer). The files in examples/data/arith/
are this module's output (`python -m kuberl.local.arith examples/data/arith`), and a test checks
that they still are. `--steps` makes the generation-heavy variant of `benchmarks/vs_trl.py
--task long`: three-digit operands whose SFT responses are a worked trace, one line per column
with its carry, ending in `#### <sum>` (80-108 characters, so 81-109 tokens with EOS).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path

MAX_OPERAND = 49
# Compact on purpose: the tiny model learns this format within the demo's warm start and barely
# learns a spelt-out one ("Q: What is 23 + 17?\nA: "); figures in docs/local.md.
TEMPLATE = "Q: {a}+{b}=\nA: "


def question(a: int, b: int) -> tuple[str, str]:
    """(prompt, answer) of one question."""
    return TEMPLATE.format(a=a, b=b), str(a + b)


def worked_steps(a: int, b: int) -> str:
    """The column-by-column trace of a + b, least significant digit first, then `#### a+b`:
    "7+5+0=12 write 2 carry 1" per column (a final carry gets a column of its own)."""
    lines, carry, i = [], 0, 0
    while i < max(len(str(a)), len(str(b))) or carry:
        x, y = a // 10**i % 10, b // 10**i % 10
        total = x + y + carry
        lines.append(f"{x}+{y}+{carry}={total} write {total % 10} carry {total // 10}")
        carry, i = total // 10, i + 1
    return "\n".join(lines) + f"\n#### {a + b}"


def split_pairs(
    seed: int, n_eval: int, operands: range = range(MAX_OPERAND + 1)
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Every operand pair, shuffled with seed, split into (train pairs, held-out eval pairs)."""
    pairs = [(a, b) for a in operands for b in operands]
    random.Random(seed).shuffle(pairs)
    if not 0 < n_eval < len(pairs):
        raise ValueError(f"n_eval must be between 1 and {len(pairs) - 1}, got {n_eval}")
    return pairs[n_eval:], pairs[:n_eval]


def generate(
    seed: int = 0, n_train: int = 4000, n_eval: int = 200, n_sft: int = 2000, steps: bool = False
) -> dict[str, list[dict[str, str]]]:
    """The three datasets as lists of rows: `train`, RL prompts `{"prompt", "answer"}` drawn
    with repetition; `eval`, `n_eval` held-out prompts (operands 0..49 give 2,500 questions, and
    no eval question is in `train` or `sft`); `sft`, distinct warm-start examples
    `{"prompt", "response"}`. With `steps`, operands are 100..999 and each SFT response is the
    `worked_steps` trace (the answer stays the bare sum: the verifier reads the `####` number)."""
    operands = range(100, 1000) if steps else range(MAX_OPERAND + 1)
    train_pairs, eval_pairs = split_pairs(seed, n_eval, operands)
    if n_sft > len(train_pairs):
        raise ValueError(f"n_sft must be at most {len(train_pairs)}, got {n_sft}")
    rng = random.Random(seed + 1)
    train = [question(*rng.choice(train_pairs)) for _ in range(n_train)]
    sft_pairs = rng.sample(train_pairs, n_sft)
    return {
        "train": [{"prompt": p, "answer": a} for p, a in train],
        "eval": [{"prompt": p, "answer": a} for p, a in (question(*e) for e in eval_pairs)],
        "sft": [
            {"prompt": question(a, b)[0], "response": worked_steps(a, b) if steps else str(a + b)}
            for a, b in sft_pairs
        ],
    }


def write(out_dir: Path, datasets: dict[str, list[dict[str, str]]]) -> list[Path]:
    """Write `<name>.jsonl` for each dataset; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in datasets.items():
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--sft", type=int, default=2000)
    parser.add_argument("--steps", action="store_true", help="three digits, worked-steps SFT")
    args = parser.parse_args(argv)
    datasets = generate(args.seed, args.train, args.eval, args.sft, args.steps)
    for path in write(args.out_dir, datasets):
        print(path)


if __name__ == "__main__":
    main()
