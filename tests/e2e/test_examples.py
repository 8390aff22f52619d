"""The example job files: they validate with `kuberl config check`, and the demo's data files are
exactly what its generator writes, with the eval questions held out of SFT and RL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kuberl.common.config import load_job_config
from kuberl.local import arith
from tests.support import REPO

EXAMPLES = REPO / "examples"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_kuberl_config_check_accepts_the_example(name: str) -> None:
    check = subprocess.run(
        [sys.executable, "-m", "kuberl.cli", "config", "check", str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin"},  # no KUBERL_* overrides from the caller
    )
    assert (check.returncode, check.stderr) == (0, "")


def test_the_gpu_example_is_qwen_on_gsm8k_with_sglang_and_zero2() -> None:
    config = load_job_config(EXAMPLES / "gsm8k-qwen.yaml", env={})
    assert (
        config.model.path,
        config.rollout.engine.kind,
        config.trainer.zero_stage,
        [ds.path for ds in config.data.train],
        config.weight_sync.transports[0],
        config.weight_sync.device,
    ) == ("/models/Qwen2.5-1.5B-Instruct", "sglang", 2, ["/data/gsm8k/train.jsonl"], "nccl", "cuda")


def test_the_tools_example_calls_the_calculator_and_python_tools_it_describes_to_qwen() -> None:
    from kuberl.rollout.tools import ToolRegistry

    config = load_job_config(EXAMPLES / "gsm8k-tools.yaml", env={})
    mt = config.rollout.multi_turn
    registry = ToolRegistry.from_config(mt)
    names = [s["function"]["name"] for s in registry.schemas()]
    registry.close()
    assert (mt.enabled, mt.describe_tools, config.model.chat_template, names) == (
        True,
        True,
        True,
        ["calculator", "python"],
    )
    assert config.rollout.on_weight_update == "abort"  # a sample's turns share one version
    # Qwen's own tool turn (ChatML): the assistant turn closes, the output comes as the user's.
    assert mt.tool_response_template.replace("{output}", "84") == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_the_demo_data_files_are_the_generators_output(tmp_path: Path) -> None:
    arith.write(tmp_path, arith.generate())
    names = ("train.jsonl", "eval.jsonl", "sft.jsonl")
    assert [(tmp_path / n).read_text() for n in names] == [
        (EXAMPLES / "data" / "arith" / n).read_text() for n in names
    ]


def test_no_eval_question_appears_in_the_sft_or_rl_data() -> None:
    def prompts(name: str) -> set[str]:
        path = EXAMPLES / "data" / "arith" / name
        return {json.loads(line)["prompt"] for line in path.read_text().splitlines()}

    held_out = prompts("eval.jsonl")
    assert (len(held_out), held_out & (prompts("train.jsonl") | prompts("sft.jsonl"))) == (
        200,
        set(),
    )


def test_every_demo_answer_is_the_sum_of_its_question() -> None:
    rows = [
        json.loads(line)
        for name in ("train.jsonl", "eval.jsonl")
        for line in (EXAMPLES / "data" / "arith" / name).read_text().splitlines()
    ]
    wrong = []
    for row in rows:
        a, b = row["prompt"].removeprefix("Q: ").split("=")[0].split("+")
        if int(a) + int(b) != int(row["answer"]):
            wrong.append(row)
    assert (len(rows), wrong) == (4200, [])


def test_a_worked_trace_adds_column_by_column_and_the_verifier_reads_its_sum() -> None:
    from kuberl.reward.sample import RewardSample
    from kuberl.reward.verifiers import gsm8k

    trace = arith.worked_steps(947, 85)
    assert trace == (
        "7+5+0=12 write 2 carry 1\n4+8+1=13 write 3 carry 1\n9+0+1=10 write 0 carry 1\n"
        "0+0+1=1 write 1 carry 0\n#### 1032"
    )
    prompt, answer = arith.question(947, 85)
    sample = RewardSample(prompt=prompt, response=trace, answer=answer)
    assert gsm8k.score(sample).score == 1.0


def test_the_worked_steps_data_hold_three_digit_questions_out_of_sft_and_rl() -> None:
    data = arith.generate(steps=True)
    held_out = {r["prompt"] for r in data["eval"]}
    seen = {r["prompt"] for r in data["train"] + data["sft"]}
    sft = data["sft"][0]
    a, b = (int(x) for x in sft["prompt"][3:].split("=")[0].split("+"))
    assert (len(held_out), held_out & seen) == (200, set())
    assert sft["response"] == arith.worked_steps(a, b) and 100 <= min(a, b) <= max(a, b) <= 999
