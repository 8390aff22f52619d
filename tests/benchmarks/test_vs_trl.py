"""benchmarks/vs_trl.py: both sides get the demo's settings, one evaluator judges both, and the
headline ratio is computed as documented; `--quick` runs every stage end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kuberl.common.config import load_job_config
from tests.benchmarks import load
from tests.support import REPO

vs_trl = load("vs_trl")


def _curve(points: list[tuple[int, float, float]]) -> list[dict[str, Any]]:
    return [{"step": s, "seconds": t, "accuracy": a} for s, t, a in points]


def _side(wall: float, cpu: float = 10.0) -> dict[str, Any]:
    return {
        "wall_seconds": wall,
        "samples": 1280,
        "cpu_seconds": cpu,
        "startup_seconds": 1.0,
        "excluded_seconds": 0.0,
        "threads": 1,
        "trl_version": "x",
        "first_step_seconds": 1.0,
        "process_seconds": wall + 5,
        "summary": {},
    }


def test_both_sides_get_the_demo_jobs_rl_settings() -> None:
    settings = vs_trl.rl_settings(vs_trl.load_demo(vs_trl.DEMO))
    job = load_job_config(REPO / "examples" / "demo.yaml", env={})
    assert (
        settings["group_size"],
        settings["groups_per_step"],
        settings["rl_steps"],
        settings["lr"],
        settings["temperature"],
        settings["max_new_tokens"],
        settings["sft_steps"],
        (settings["clip_low"], settings["clip_high"]),
        Path(settings["train_file"]),
    ) == (
        job.rollout.group_size,
        job.trainer.groups_per_step,
        job.trainer.total_steps,
        job.trainer.optimizer.lr,
        job.rollout.sampling.temperature,
        job.rollout.sampling.max_new_tokens,
        job.trainer.sft_steps,
        (job.trainer.algorithm.clip_low, job.trainer.algorithm.clip_high),
        (REPO / job.data.train[0].path).resolve(),
    )


def test_trls_reward_function_is_the_gsm8k_verifier() -> None:
    prompts = ["Q: What is 23 + 17?\nA: "] * 3
    rewards = vs_trl.verifier_reward(prompts, ["40", "41", "40 or 41"], answer=["40"] * 3)
    assert rewards == [1.0, 0.0, 0.0]


def test_smoothing_averages_each_point_with_up_to_two_rl_points_before_it() -> None:
    curve = _curve([(0, 0, 0.5), (10, 1, 0.6), (20, 2, 0.9), (30, 3, 0.6), (40, 4, 0.3)])
    assert vs_trl.smoothed(curve, 3) == pytest.approx([0.5, 0.6, 0.75, 0.7, 0.6])


def test_kuberl_reaches_trls_final_accuracy_at_its_first_smoothed_point_that_high() -> None:
    # TRL: final (mean of its last three) = (0.8 + 0.9 + 0.7) / 3 = 0.8, wall 100 s.
    trl = _curve([(0, 0, 0.5), (10, 40, 0.6), (20, 60, 0.8), (30, 80, 0.9), (40, 100, 0.7)])
    # kuberl: smoothed 0.7 (20 s), 0.75 (30 s), 0.8 (50 s), so 50 s.
    kub = _curve([(0, 0, 0.5), (10, 20, 0.7), (20, 30, 0.8), (30, 50, 0.9), (40, 70, 0.9)])
    result = vs_trl.figures(_side(100.0, 20.0), _side(70.0, 30.0), trl, kub)
    assert (
        result["trl"]["final_accuracy"],
        result["kuberl_seconds_to_trl_final_accuracy"],
        result["ratio_kuberl_time_to_trl_final_over_trl_wall"],
        result["goal_met"],
        result["ratio_wall_kuberl_over_trl"],
        result["ratio_cpu_seconds_kuberl_over_trl"],
    ) == (pytest.approx(0.8), 50.0, 0.5, True, 0.7, 1.5)


def test_never_reaching_trls_final_accuracy_gives_no_ratio_and_misses_the_goal() -> None:
    trl = _curve([(0, 0, 0.5), (10, 40, 0.9)])
    kub = _curve([(0, 0, 0.5), (10, 20, 0.6), (20, 60, 0.7)])
    result = vs_trl.figures(_side(40.0), _side(60.0), trl, kub)
    assert (
        result["kuberl_seconds_to_trl_final_accuracy"],
        result["ratio_kuberl_time_to_trl_final_over_trl_wall"],
        result["goal_met"],
    ) == (None, None, False)


def test_accuracy_at_equal_wall_time_is_the_last_policy_saved_by_the_shorter_runs_end() -> None:
    # The shorter run (kuberl, 50 s) sets the time; TRL's policy saved by 50 s is step 10's.
    trl = _curve([(0, 0, 0.5), (10, 45, 0.7), (20, 90, 0.9)])
    kub = _curve([(0, 0, 0.5), (10, 30, 0.6), (20, 50, 0.8)])
    result = vs_trl.figures(_side(90.0), _side(50.0), trl, kub, window=1)
    assert (
        result["equal_wall_time_seconds"],
        result["trl"]["accuracy_at_equal_wall_time"],
        result["kuberl"]["accuracy_at_equal_wall_time"],
    ) == (50.0, 0.7, 0.8)


def test_greedy_accuracy_of_a_batch_equals_prompt_by_prompt_greedy_decoding(tmp_path: Path) -> None:
    """Left padding in the batched evaluator must not change any answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kuberl.common.modelbuild import build_model
    from kuberl.reward.sample import RewardSample
    from kuberl.reward.verifiers import gsm8k

    model_dir = build_model(tmp_path / "model", size="tiny", tokenizer="digits", seed=3)
    rows = [json.loads(x) for x in (REPO / "examples/data/arith/eval.jsonl").open()][:24]
    # A made-up model answers garbage; make half the gold answers whatever it says, so the
    # accuracy is neither 0 nor 1 and a padding bug would change it.
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    texts = []
    for r in rows:
        ids = torch.tensor([tok.encode(r["prompt"], add_special_tokens=False)])
        out = model.generate(input_ids=ids, do_sample=False, max_new_tokens=6)
        texts.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    for i, (r, t) in enumerate(zip(rows, texts, strict=True)):
        number = gsm8k.extract_answer(t, r["prompt"]).text
        if i % 2 == 0 and number:
            r["answer"] = number
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = sum(
        gsm8k.score(RewardSample(prompt=r["prompt"], response=t, answer=r["answer"])).score
        for r, t in zip(rows, texts, strict=True)
    ) / len(rows)

    assert vs_trl.greedy_accuracy(model_dir, model_dir, eval_file, 6) == expected


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_quick_run_trains_both_sides_on_equal_samples_and_prints_the_json_line(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERL_")}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "vs_trl.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=380,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (pair,) = result["pairs"]
    trl, kub = pair["trl"], pair["kuberl"]
    steps = [[p["step"] for p in side["curve"]] for side in (trl, kub)]
    assert (
        result["benchmark"],
        trl["samples"],
        kub["samples"],
        steps,
        trl["curve"][0]["accuracy"] == kub["curve"][0]["accuracy"],  # the same warm start
        all(side["wall_seconds"] > 0 and side["cpu_seconds"] > 0 for side in (trl, kub)),
        "ratio_kuberl_time_to_trl_final_over_trl_wall" in result,
        isinstance(result["goal_met"], bool),
        result["trl"]["samples"],
    ) == ("vs_trl", 6 * 128, 6 * 128, [[0, 2, 4, 6]] * 2, True, True, True, True, 6 * 128)


def test_the_headline_is_the_median_over_pairs_with_never_reached_counting_as_infinite() -> None:
    def pair(ratio: float | None, wall: float) -> dict[str, Any]:
        side = {
            "wall_seconds": wall,
            "samples": 1280,
            "samples_per_second": 1280 / wall,
            "cpu_seconds": 1.0,
            "final_accuracy": 0.9,
            "accuracy_at_equal_wall_time": 0.9,
            "version": "x",
        }
        ratios = {
            "ratio_kuberl_time_to_trl_final_over_trl_wall": ratio,
            "ratio_wall_kuberl_over_trl": 1.0,
            "ratio_samples_per_second_kuberl_over_trl": 1.0,
            "ratio_cpu_seconds_kuberl_over_trl": 1.0,
            "kuberl_seconds_to_trl_final_accuracy": None if ratio is None else ratio * wall,
            "equal_wall_time_seconds": wall,
        }
        curve = _curve([(0, 0, 0.5), (10, 50, 0.8), (20, 100, 0.9)])
        return {"trl": {**side, "curve": curve}, "kuberl": {**side, "curve": curve}, **ratios}

    three = vs_trl.summarize([pair(0.6, 100.0), pair(None, 100.0), pair(0.8, 100.0)])
    two = vs_trl.summarize([pair(0.6, 100.0), pair(None, 100.0)])
    assert (
        three["ratio_kuberl_time_to_trl_final_over_trl_wall"],
        three["goal_met"],
        three["pair_ratios"],
        two["ratio_kuberl_time_to_trl_final_over_trl_wall"],
        two["goal_met"],
    ) == (0.8, False, [0.6, None, 0.8], None, False)


def test_learning_per_sample_compares_the_second_halves_pair_by_pair() -> None:
    # Steps 0-40, so the second half is steps 30 and 40.
    def pair(trl: tuple[float, float], kub: tuple[float, float], finals: tuple[float, float]):
        def side(late: tuple[float, float], final: float) -> dict[str, Any]:
            points = [
                (0, 0, 0.5),
                (10, 10, 0.7),
                (20, 20, 0.8),
                (30, 30, late[0]),
                (40, 40, late[1]),
            ]
            return {"curve": _curve(points), "final_accuracy": final}

        return {"trl": side(trl, finals[0]), "kuberl": side(kub, finals[1])}

    result = vs_trl.learning_per_sample(
        [pair((0.9, 0.8), (0.8, 0.8), (0.85, 0.80)), pair((0.9, 0.9), (1.0, 0.9), (0.9, 0.96))]
    )
    # Second halves: TRL 0.85 and 0.9, kuberl 0.8 and 0.95: differences -0.05 and +0.05, so a
    # mean of 0 with standard error stdev(-0.05, 0.05) / sqrt(2) = 0.0707 / 1.414 = 0.05.
    # Finals: -0.05 and +0.06: mean 0.005, stderr stdev / sqrt(2) = 0.0778 / 1.414 = 0.055.
    # Neighbour changes in the second halves: -0.1, 0, 0, -0.1: stdev 0.0577, / sqrt(2) = 0.0408.
    assert result == {
        "second_half_accuracy": {"trl": [0.85, 0.9], "kuberl": [0.8, 0.95]},
        "second_half_difference": pytest.approx(0.0, abs=1e-9),
        "second_half_difference_stderr": pytest.approx(0.05),
        "final_accuracy_difference": pytest.approx(0.005),
        "final_accuracy_difference_stderr": pytest.approx(0.055),
        "eval_noise": pytest.approx(0.0408),
    }


def test_each_pair_seeds_both_sides_with_the_first_seed_plus_its_index(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Stand-ins for the three heavy stages (training both sides and evaluating): this checks
    # only which seed each side of each pair is given.
    seeds: dict[str, list[int]] = {"trl": [], "kuberl": []}

    def trl(spec: dict[str, Any], out: Path, threads: int, timeout: float) -> dict[str, Any]:
        seeds["trl"].append(spec["seed"])
        return {**_side(10.0), "snapshots": []}

    def kuberl(doc: dict[str, Any], *args: Any) -> dict[str, Any]:
        seeds["kuberl"].append(args[-1])
        return {**_side(10.0), "snapshots": []}

    class Evaluator:
        def __init__(self, *args: Any) -> None:
            pass

        def accuracy(self) -> float:
            return 0.5

        def curve(self, snapshots: list[Any], start: float) -> list[dict[str, Any]]:
            return _curve([(0, 0.0, start)])

    monkeypatch.setattr(vs_trl, "run_trl", trl)
    monkeypatch.setattr(vs_trl, "run_kuberl", kuberl)
    monkeypatch.setattr(vs_trl, "Evaluator", Evaluator)
    argv = ["--repeat", "3", "--warm-start", str(tmp_path), "--out", str(tmp_path / "out")]
    assert vs_trl.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    base = vs_trl.rl_settings(vs_trl.load_demo(vs_trl.DEMO))["seed"]
    expected = [base, base + 1, base + 2]
    assert (seeds["trl"], seeds["kuberl"], [p["seed"] for p in result["pairs"]]) == (
        expected,
        expected,
        expected,
    )
    # --seed moves the first pair's seed (more replicates from the same warm start).
    seeds = {"trl": [], "kuberl": []}
    assert vs_trl.main([*argv, "--seed", "7"]) == 0
    assert (seeds["trl"], seeds["kuberl"]) == ([7, 8, 9], [7, 8, 9])


def test_the_long_task_gives_both_sides_long_worked_traces_and_the_same_settings(
    tmp_path: Path,
) -> None:
    from kuberl.common.modelbuild import build_tokenizer

    doc = vs_trl.long_task(vs_trl.load_demo(vs_trl.DEMO), tmp_path)
    settings = vs_trl.rl_settings(doc)
    sft = vs_trl.read_jsonl(Path(doc["trainer"]["sft_data"]))
    tok = build_tokenizer("digits")
    lengths = [len(tok.encode(r["response"], add_special_tokens=False)) + 1 for r in sft]  # EOS
    assert (
        settings["max_new_tokens"],
        settings["groups_per_step"],
        settings["group_size"],
        settings["lr"],
    ) == (128, 3, 8, 2e-5)
    assert min(lengths) >= 48 and max(lengths) <= settings["max_new_tokens"]
    assert Path(settings["train_file"]).parent == tmp_path / "data-long"
    # Two steps ahead, as the demo's window is at its 16 groups per step.
    assert doc["buffer"]["max_inflight_groups"] == 2 * settings["groups_per_step"]
    assert doc["rollout"]["prompts_per_batch"] == settings["groups_per_step"]
    eval_prompts = {r["prompt"] for r in vs_trl.read_jsonl(Path(settings["eval_file"]))}
    assert not eval_prompts & {r["prompt"] for r in sft}
