"""The reward Scorer with its real worker processes, sandbox and a tiny reward model: weighted
combinations, per-sample overrides, and custom functions that raise, hang, return NaN or kill
their worker, each giving the fallback reward with a reason while the pool heals itself."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from kuberl.common.config import RewardModelConfig, parse_job_config
from kuberl.common.errors import InvalidArgument
from kuberl.reward.sample import RewardSample
from kuberl.reward.scorer import Scorer, ScoreResult
from kuberl.reward.verifiers.reward_model import RewardModel

PLUGINS = "tests.unit.reward_plugins"
CUSTOM = {
    "exact": "exact_match",
    "tokens": "token_count",
    "raises": "raises",
    "hangs": "hangs",
    "nan": "returns_nan",
    "text": "returns_text",
    "exits": "exits_worker",
    "pid": "worker_pid",
    "alen": "async_length",
    "ahangs": "async_hangs",
    "anan": "async_nan",
}
FALLBACK = -0.25
TIMEOUT = 1.5


def build_reward_model(path: Path, seed: int = 0, num_labels: int = 1) -> Path:
    """A 2-layer random Qwen2 sequence classifier with kuberl's character tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from kuberl.common.modelbuild import build_tokenizer

    tok = build_tokenizer("digits")
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_labels=num_labels,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


class Harness:
    """A started Scorer on a private event loop, driven synchronously by the tests."""

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def score(
        self, *samples: RewardSample, verifiers: list[str] | None = None
    ) -> list[ScoreResult]:
        combos = [self.scorer.combination(verifiers or [], s.sample_id) for s in samples]
        return list(self.run(self.scorer.score(list(samples), combos)))

    def one(self, verifiers: list[str], **fields: Any) -> ScoreResult:
        return self.score(RewardSample(**fields), verifiers=verifiers)[0]

    def wait_for_workers(self, n: int, timeout: float = 60.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while len(self.scorer.pool.pids) < n and time.monotonic() < deadline:
            self.run(asyncio.sleep(0.05))
        return self.scorer.pool.pids


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    rm_path = build_reward_model(tmp_path_factory.mktemp("rm"))
    job = parse_job_config(
        {
            "reward": {
                "verifiers": {"gsm8k": 1.0, "format": 0.5},
                "custom": {k: {"function": f"{PLUGINS}:{v}"} for k, v in CUSTOM.items()},
                "timeout_seconds": TIMEOUT,
                "fallback_reward": FALLBACK,
                "workers": 2,
                "length_soft_limit": 80,
                "length_penalty_buffer": 20,
                "sandbox": {"wall_seconds": 3, "cpu_seconds": 1},
                "reward_model": {"path": str(rm_path), "batch_size": 3},
            }
        },
        env={},
    )
    h = Harness(Scorer(job))
    h.run(h.scorer.start())
    yield h
    h.run(h.scorer.stop())
    h.loop.close()


def _errors(verifier: str, reason: str) -> float:
    labels = {"verifier": verifier, "reason": reason}
    return REGISTRY.get_sample_value("kuberl_reward_errors_total", labels) or 0.0


def test_the_job_combination_is_the_weighted_sum_with_a_breakdown(harness: Harness) -> None:
    r = harness.one([], response="<think>9*8</think> #### 72", answer="#### 72")
    assert (r.reward, r.breakdown, r.error) == (1.5, {"gsm8k": 1.0, "format": 1.0}, "")


def test_a_samples_own_verifiers_and_weights_replace_the_job_combination(
    harness: Harness,
) -> None:
    # exact (weight 1, not in the job) = 1; length=2 with 90 tokens = 2 * -0.5.
    r = harness.one(["exact", "length=2"], response="42", answer="42", response_token_ids=[7] * 90)
    assert (r.reward, r.breakdown) == (0.0, {"exact": 1.0, "length": -0.5, "length/tokens": 90.0})


def test_a_verifier_named_without_weight_keeps_its_job_weight(harness: Harness) -> None:
    r = harness.one(["format"], response="<think>x</think> y")
    assert r.reward == 0.5


@pytest.mark.parametrize(
    ("entry", "message"),
    [("nope", "unknown verifier 'nope'"), ("gsm8k=abc", "weight must be a finite number")],
)
def test_unknown_verifiers_and_bad_weights_are_invalid_arguments(
    harness: Harness, entry: str, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        harness.scorer.combination([entry], "s1")


def test_custom_functions_receive_token_ids_and_may_return_a_verdict(harness: Harness) -> None:
    r = harness.one(["tokens"], response="abc", response_token_ids=[1, 2, 3, 4, 5])
    assert (r.reward, r.breakdown, r.details) == (
        0.5,
        {"tokens": 0.5, "tokens/tokens": 5.0},
        "tokens: 5 tokens",
    )


@pytest.mark.parametrize(
    ("verifier", "reason", "message"),
    [
        ("raises", "exception", "RuntimeError: reward function exploded"),
        ("nan", "non_finite", "returned nan"),
        ("text", "bad_return", "returned str, expected a number"),
        ("anan", "non_finite", "returned nan"),
    ],
)
def test_a_failing_custom_function_gives_the_fallback_reward_and_a_counted_reason(
    harness: Harness, verifier: str, reason: str, message: str
) -> None:
    before = _errors(verifier, reason)
    r = harness.one([verifier, "exact"], response="a", answer="a")
    assert (r.reward, r.breakdown, f"{verifier}: {reason}: " in r.error, message in r.error) == (
        FALLBACK,
        {"exact": 1.0},
        True,
        True,
    )
    assert _errors(verifier, reason) == before + 1


def test_a_failure_in_one_sample_does_not_touch_the_others_of_the_batch(
    harness: Harness,
) -> None:
    good = RewardSample(sample_id="good", response="#### 3", answer="#### 3")
    bad = RewardSample(sample_id="bad", response="#### 3", answer="no number here")
    rewards = [(r.sample_id, r.reward) for r in harness.score(good, bad, verifiers=["gsm8k"])]
    assert rewards == [("good", 1.0), ("bad", FALLBACK)]


def test_a_hanging_function_times_out_and_its_worker_is_killed_and_replaced(
    harness: Harness,
) -> None:
    before = set(harness.wait_for_workers(2))
    good = [RewardSample(sample_id=f"g{i}", response="a", answer="a") for i in range(12)]
    hung = RewardSample(sample_id="hung", response="a", answer="a")
    combos = [{"exact": 1.0}] * 6 + [{"exact": 1.0, "hangs": 1.0}] + [{"exact": 1.0}] * 6
    batch = [*good[:6], hung, *good[6:]]
    results = harness.run(harness.scorer.score(batch, combos))
    after = set(harness.wait_for_workers(2))
    killed = before - after
    # The samples that shared a chunk with the hung one are re-run, not failed.
    assert [r.reward for r in results] == [1.0] * 6 + [FALLBACK] + [1.0] * 6
    assert results[6].error.startswith("hangs: timeout: no result after 1.5s (worker killed)")
    assert (len(after), len(killed) >= 1) == (2, True)
    for pid in killed:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # Both workers, the new ones included, keep scoring.
    samples = [RewardSample(sample_id=str(i)) for i in range(20)]
    assert {int(r.reward) for r in harness.score(*samples, verifiers=["pid"])} <= after


def test_a_function_that_kills_its_worker_is_reported_and_the_worker_replaced(
    harness: Harness,
) -> None:
    before = set(harness.wait_for_workers(2))
    r = harness.one(["exits"], response="x")
    after = set(harness.wait_for_workers(2))
    assert (r.reward, "exits: worker_died" in r.error, len(before - after)) == (FALLBACK, True, 1)


def test_a_sample_the_pool_cannot_send_to_a_worker_fails_alone_and_every_slot_keeps_serving(
    harness: Harness,
) -> None:
    # The service refuses such metadata (too deep) before it gets here; in-process nothing does.
    # json.dumps raises RecursionError on it, which once ended the pool slot's task for good, so
    # that the sample's caller and every later one waiting for that slot hung.
    nested: dict[str, Any] = {}
    deep = nested
    for _ in range(5000):
        deep["a"] = {}
        deep = deep["a"]
    before = set(harness.wait_for_workers(2))
    bad = RewardSample(sample_id="deep", response="a", answer="a", metadata=nested)
    good = [RewardSample(sample_id=f"g{i}", response="a", answer="a") for i in range(4)]
    results = harness.run(
        asyncio.wait_for(harness.scorer.score([bad, *good], [{"exact": 1.0}] * 5), 30)
    )
    assert [r.reward for r in results] == [FALLBACK] + [1.0] * 4
    assert results[0].error.startswith("exact: error: could not score: RecursionError")
    after = set(harness.wait_for_workers(2))
    samples = [RewardSample(sample_id=str(i)) for i in range(20)]
    scored = harness.run(asyncio.wait_for(harness.scorer.score(samples, [{"pid": 1.0}] * 20), 30))
    assert {int(r.reward) for r in scored} <= after
    assert len(after) == 2 and len(before) == 2


def test_async_functions_run_on_the_event_loop(harness: Harness) -> None:
    assert harness.one(["alen"], response="hello").reward == 5.0


def test_a_hanging_async_function_is_cancelled_at_the_timeout(harness: Harness) -> None:
    r = harness.one(["ahangs"], response="x")
    assert (r.reward, r.error) == (FALLBACK, "ahangs: timeout: no result after 1.5s")


def test_code_runs_in_the_sandbox_and_scores_the_fraction_passed(harness: Harness) -> None:
    tests = [{"input": "2\n", "output": "4"}, {"input": "3\n", "output": "6"}]
    tests.append({"input": "5\n", "output": "11"})
    r = harness.one(
        ["code"], response="```python\nprint(int(input()) * 2)\n```", metadata={"tests": tests}
    )
    assert (r.reward, r.breakdown["code/passed"], r.breakdown["code/wrong_answer"]) == (
        pytest.approx(2 / 3),
        2.0,
        1.0,
    )


def test_code_samples_waiting_for_a_sandbox_slot_are_not_timed_out_for_the_wait(
    harness: Harness,
) -> None:
    # 22 programs of ~0.6 s through the 2 slots take ~7 s in all, past the 5.5 s (timeout 1.5 +
    # backstop 3 + 1) that once timed each sample from the call's start: the last ones then got
    # the fallback without running.
    program = "```python\nimport time\ntime.sleep(0.6)\nprint(int(input()) * 2)\n```"
    tests = {"tests": [{"input": "2\n", "output": "4"}]}
    samples = [RewardSample(sample_id=str(i), response=program, metadata=tests) for i in range(22)]
    started = time.monotonic()
    results = harness.score(*samples, verifiers=["code"])
    seconds = time.monotonic() - started
    assert [(r.reward, r.error) for r in results] == [(1.0, "")] * 22
    assert seconds > 5.5  # otherwise the test no longer shows anything


class SlowModel:
    """The harness's real reward model, each forward held back by the next of `seconds`."""

    def __init__(self, model: Any, seconds: list[float]) -> None:
        self.model, self.seconds, self.calls = model, iter(seconds), 0

    def __call__(self, **batch: Any) -> Any:
        time.sleep(next(self.seconds))
        self.calls += 1
        return self.model(**batch)


def test_reward_model_batches_take_turns_and_waiting_for_a_turn_is_not_timed(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 1 s a batch (TIMEOUT 1.5 s): three concurrent calls wait up to 2 s for their turn. Timing
    # the wait failed 5 of their 6 samples and still ran all three batches, the later ones after
    # their callers had given up.
    rm = harness.scorer.reward_model
    assert rm is not None
    slow = SlowModel(rm._model, [1.0] * 3)
    monkeypatch.setattr(rm, "_model", slow)

    async def three_calls() -> list[list[ScoreResult]]:
        calls = []
        for c in range(3):
            two = [RewardSample(sample_id=f"{c}{i}", response="1" * (c + i + 1)) for i in range(2)]
            calls.append(harness.scorer.score(two, [{"rm": 1.0}] * 2))
        return list(await asyncio.gather(*calls))

    results = harness.run(three_calls())
    assert [[r.error for r in call] for call in results] == [["", ""]] * 3
    assert slow.calls == 3


def test_a_reward_model_batch_that_times_out_keeps_the_turn_until_it_ends(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2 s (past TIMEOUT): the first call times out; the second waits until the model is free
    # and then has its whole TIMEOUT.
    rm = harness.scorer.reward_model
    assert rm is not None
    monkeypatch.setattr(rm, "_model", SlowModel(rm._model, [2.0, 1.0]))

    async def two_calls() -> list[list[ScoreResult]]:
        first = asyncio.ensure_future(
            harness.scorer.score([RewardSample(sample_id="a", response="1")], [{"rm": 1.0}])
        )
        await asyncio.sleep(0.1)
        second = harness.scorer.score([RewardSample(sample_id="b", response="1")], [{"rm": 1.0}])
        return list(await asyncio.gather(first, second))

    (first,), (second,) = harness.run(two_calls())
    assert (first.reward, first.error) == (FALLBACK, "rm: timeout: batch not scored in 1.5s")
    assert second.error == ""


def test_code_with_assert_tests_skips_the_main_block(harness: Harness) -> None:
    program = "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    input()\n"
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]
    r = harness.one(["code"], response=program, metadata={"tests": tests})
    assert (r.reward, r.breakdown["code/wrong_answer"]) == (0.5, 1.0)


def test_code_without_tests_in_the_metadata_is_a_verifier_error(harness: Harness) -> None:
    r = harness.one(["code"], response="print(1)")
    assert (r.reward, r.error) == (
        FALLBACK,
        "code: exception: ValueError: the code verifier needs metadata.tests (see docs/reward.md)",
    )


def test_the_reward_model_scores_batches_like_single_unpadded_forwards(
    harness: Harness,
) -> None:
    import torch

    rm = harness.scorer.reward_model
    assert rm is not None
    pairs = [("2+2=", "4"), ("What is 7*6? ", "It is 42, I think."), ("hi", ""), ("a", "b" * 40)]
    samples = [
        RewardSample(sample_id=str(i), prompt=p, response=r) for i, (p, r) in enumerate(pairs)
    ]
    batched = [r.breakdown["rm"] for r in harness.score(*samples, verifiers=["rm"])]
    with torch.inference_mode():
        single = [
            rm._model(**rm._tokenizer(p + r, return_tensors="pt")).logits[0, 0].item()
            for p, r in pairs
        ]
    assert batched == pytest.approx(single, abs=1e-5)
    assert len(set(batched)) == len(batched)  # a real model: different texts, different scores


def test_a_classifier_with_several_labels_is_refused_as_a_reward_model(tmp_path: Path) -> None:
    path = build_reward_model(tmp_path, num_labels=2)
    with pytest.raises(ValueError, match="num_labels is 2"):
        RewardModel(RewardModelConfig(path=str(path))).load()


def test_the_verifier_list_has_builtins_and_customs_with_their_weights(harness: Harness) -> None:
    infos = {v.name: (v.weight, v.backend) for v in harness.scorer.verifiers()}
    assert (infos["gsm8k"], infos["format"], infos["rm"], infos["alen"], infos["raises"]) == (
        (1.0, "pool"),
        (0.5, "pool"),
        (0.0, "model"),
        (0.0, "async"),
        (0.0, "pool"),
    )


def _scorer_with_broken_sandbox(verifiers: dict[str, float]) -> Scorer:
    sandbox = {"python": "/nonexistent/python3"}
    return Scorer(
        parse_job_config({"reward": {"verifiers": verifiers, "sandbox": sandbox}}, env={})
    )


def test_a_broken_sandbox_stops_a_job_that_uses_code_from_starting() -> None:
    scorer = _scorer_with_broken_sandbox({"code": 1.0})
    with pytest.raises(RuntimeError, match="cannot run /nonexistent/python3"):
        asyncio.run(scorer._probe_sandbox())


def test_a_broken_sandbox_only_disables_code_for_a_job_that_does_not_use_it() -> None:
    scorer = _scorer_with_broken_sandbox({"gsm8k": 1.0})
    asyncio.run(scorer._probe_sandbox())
    with pytest.raises(InvalidArgument, match="unknown verifier 'code'"):
        scorer.combination(["code"], "s1")


@pytest.mark.parametrize(
    ("report", "starts"),
    [
        ({"network": "namespace", "files": "private", "uid": "dedicated"}, True),
        # A mount namespace refused: runs would share the host's /tmp and /dev/shm (once let
        # through, only network and uid were checked).
        ({"network": "namespace", "files": "shared", "uid": "dedicated"}, False),
        ({"network": "none", "files": "private", "uid": "dedicated"}, False),
        ({"network": "namespace", "files": "private", "uid": "shared"}, False),
    ],
)
def test_require_isolation_refuses_a_sandbox_short_of_any_aspect(
    report: dict[str, str], starts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = {"verifiers": {"code": 1.0}, "sandbox": {"require_isolation": True}}
    scorer = Scorer(parse_job_config({"reward": job}, env={}))

    async def probe() -> dict[str, str]:  # what the launcher reported on such a host
        scorer.sandbox.isolation = report
        return report

    monkeypatch.setattr(scorer.sandbox, "probe", probe)
    if starts:
        asyncio.run(scorer._probe_sandbox())
    else:
        with pytest.raises(RuntimeError, match="require_isolation is set"):
            asyncio.run(scorer._probe_sandbox())
