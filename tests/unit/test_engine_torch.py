"""The torch engine against plain transformers: same tokens, same logprobs, same stops; pausing,
aborting and loading weights between decode steps."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kuberl.rollout.engine.base import EngineRejected, SamplingParams
from kuberl.rollout.engine.torch_engine import TorchEngine, sample_tokens
from tests.tiny_models import build_model, build_tokenizer, save_tiny_model

PROMPTS = ["What is 2+3?", "Hi", "Tell me a story about seven cats"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models on a shared CPU run far faster on one intra-op thread than on two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_model(tokenizer, seed=0)


@pytest.fixture
def engine(model, tokenizer) -> Iterator[TorchEngine]:
    eng = TorchEngine(model, tokenizer, max_batch_size=16, seed=1)
    yield eng
    asyncio.run(eng.close())


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(t)["input_ids"] for t in texts]


def _generate(engine: TorchEngine, prompts, params: SamplingParams):
    async def go():
        try:
            return await engine.generate(prompts, params)
        finally:
            await engine.close()

    return asyncio.run(go())


def _reference_logprobs(model, prompt: list[int], response: list[int], temperature: float):
    """log_softmax(logits / T) of each response token from one unpadded forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()  # [P+R, V]
    scale = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / scale, dim=-1)
    return [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(response)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_new_tokens=24, n=1),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=24, n=3),
        SamplingParams(temperature=1.3, max_new_tokens=24, n=2),
    ],
    ids=["greedy", "top_p_top_k", "hot"],
)
def test_logprobs_match_a_plain_forward_pass_on_the_same_tokens(
    engine, model, tokenizer, params
) -> None:
    prompts = _ids(tokenizer, PROMPTS)
    out = _generate(engine, prompts, params)
    worst = 0.0
    for prompt, samples in zip(prompts, out, strict=True):
        assert len(samples) == params.n
        for c in samples:
            ref = _reference_logprobs(model, prompt, c.token_ids, params.temperature)
            worst = max(worst, *(abs(a - b) for a, b in zip(ref, c.logprobs, strict=True)))
    assert worst < 1e-4


def test_greedy_generation_matches_transformers_generate(engine, model, tokenizer) -> None:
    prompts = _ids(tokenizer, PROMPTS)
    out = _generate(
        engine, prompts, SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    )
    expected = []
    for p in prompts:
        with torch.no_grad():
            g = model.generate(
                torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None
            )
        expected.append(g[0, len(p) :].tolist())
    assert [s[0].token_ids for s in out] == expected


def test_greedy_generation_is_deterministic_alone_and_in_a_batch(model, tokenizer) -> None:
    prompts = _ids(tokenizer, PROMPTS)
    params = SamplingParams(temperature=0, max_new_tokens=30, n=2)
    batched = [
        [c.token_ids for c in s] for s in _generate(TorchEngine(model, tokenizer), prompts, params)
    ]
    again = [
        [c.token_ids for c in s] for s in _generate(TorchEngine(model, tokenizer), prompts, params)
    ]
    alone = [
        [c.token_ids for c in _generate(TorchEngine(model, tokenizer), [p], params)[0]]
        for p in prompts
    ]
    assert batched == again == alone


def test_sampling_with_the_same_seed_repeats_and_another_seed_differs(model, tokenizer) -> None:
    prompts = _ids(tokenizer, PROMPTS)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, n=2)

    def run(seed: int) -> list[list[int]]:
        out = _generate(TorchEngine(model, tokenizer, seed=seed), prompts, params)
        return [c.token_ids for s in out for c in s]

    first, second, other = run(7), run(7), run(8)
    assert (first == second, first != other) == (True, True)


def test_each_replica_samples_from_its_own_seed_and_the_same_replica_repeats(
    tmp_path: Path, tokenizer
) -> None:
    # Replicas seeded alike drew the same random numbers: the same samples for the same prompt.
    from kuberl.common.config import JobConfig
    from kuberl.rollout.engine import create_engine

    save_tiny_model(tmp_path / "model")
    config = JobConfig.model_validate(
        {"job": {"seed": 3}, "rollout": {"engine": {"kind": "torch"}}}
    )
    prompts = _ids(tokenizer, PROMPTS)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, n=2)

    def run(replica: str) -> list[list[int]]:
        built = create_engine(config, tmp_path / "model", replica)
        assert isinstance(built, TorchEngine)
        return [c.token_ids for s in _generate(built, prompts, params) for c in s]

    first, again, other = run("rollout-0"), run("rollout-0"), run("rollout-1")
    assert (first == again, first != other) == (True, True)


def test_a_stop_token_id_ends_the_response_and_is_kept(engine, tokenizer) -> None:
    prompt = _ids(tokenizer, ["What is 2+3?"])
    free = _generate(
        TorchEngine(engine.model, tokenizer),
        prompt,
        SamplingParams(temperature=0, max_new_tokens=12),
    )
    stop_at = free[0][0].token_ids[5]
    first = free[0][0].token_ids.index(stop_at)
    out = _generate(
        engine, prompt, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop_at,))
    )[0][0]
    assert (out.token_ids, out.finish_reason, out.matched_stop) == (
        free[0][0].token_ids[: first + 1],
        "stop",
        stop_at,
    )


def test_a_stop_string_ends_the_response_once_it_is_produced(engine, tokenizer) -> None:
    prompt = _ids(tokenizer, ["Tell me a story about seven cats"])
    free = _generate(
        TorchEngine(engine.model, tokenizer),
        prompt,
        SamplingParams(temperature=0, max_new_tokens=16),
    )[0][0]
    text = tokenizer.decode(free.token_ids)
    stop = text[6:8]
    out = _generate(engine, prompt, SamplingParams(temperature=0, max_new_tokens=16, stop=(stop,)))[
        0
    ][0]
    produced = tokenizer.decode(out.token_ids)
    assert (produced.endswith(stop), stop in produced[:-1], out.finish_reason) == (
        True,
        False,
        "stop",
    )


def test_max_new_tokens_ends_with_finish_reason_length(engine, tokenizer) -> None:
    out = _generate(
        engine, _ids(tokenizer, PROMPTS), SamplingParams(temperature=0, max_new_tokens=7, n=2)
    )
    assert {(len(c.token_ids), c.finish_reason) for s in out for c in s} == {(7, "length")}


def test_prompts_outside_the_vocabulary_or_empty_are_rejected(engine) -> None:
    with pytest.raises(EngineRejected, match="outside the vocabulary"):
        _generate(engine, [[1, 2, 10_000]], SamplingParams())
    with pytest.raises(EngineRejected, match="prompt 1 is empty"):
        _generate(TorchEngine(engine.model, engine.tokenizer), [[1], []], SamplingParams())


def test_sample_tokens_computes_logprobs_by_hand() -> None:
    logits = torch.tensor([[0.0, math.log(3.0), -1e9], [2.0, 0.0, 0.0]])  # [2, 3]
    tokens, lps = sample_tokens(
        logits,
        temperature=torch.tensor([0.0, 0.0]),
        top_p=torch.tensor([1.0, 1.0]),
        top_k=torch.tensor([0, 0]),
    )
    expected = [math.log(3 / 4), 2.0 - math.log(math.exp(2.0) + 2.0)]
    assert tokens.tolist() == [1, 0]
    assert lps.tolist() == pytest.approx(expected, abs=1e-6)


def test_sample_tokens_respects_top_k_and_top_p_and_reports_untruncated_logprobs() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(4000, 1)  # [4000, 3]
    gen = torch.Generator().manual_seed(0)

    def freq(top_p: float, top_k: int) -> list[float]:
        toks, lps = sample_tokens(
            logits,
            torch.full((4000,), 1.0),
            torch.full((4000,), top_p),
            torch.full((4000,), top_k),
            gen,
        )
        assert torch.allclose(lps, torch.log(torch.tensor([0.5, 0.3, 0.2]))[toks])
        return torch.bincount(toks, minlength=3).div(4000).tolist()

    free, top2, nucleus = freq(1.0, 0), freq(1.0, 2), freq(0.6, 0)
    assert free == pytest.approx([0.5, 0.3, 0.2], abs=0.03)
    assert top2 == pytest.approx([0.625, 0.375, 0.0], abs=0.03)
    assert nucleus == pytest.approx([0.625, 0.375, 0.0], abs=0.03)


async def _wait_tokens(engine: TorchEngine, at_least: int = 1) -> None:
    for _ in range(5000):
        if any(len(r.tokens) >= at_least for r in engine._running):
            return
        await asyncio.sleep(0.001)
    raise AssertionError("generation never started")


def test_an_in_place_pause_holds_generation_and_resume_continues_it_exactly(
    model, tokenizer
) -> None:
    prompt = _ids(tokenizer, ["Hi"])
    params = SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True)

    async def go():
        engine = TorchEngine(model, tokenizer)
        task = asyncio.create_task(engine.generate(prompt, params))
        await _wait_tokens(engine, 5)
        await engine.pause("in_place")
        held = len(engine._running[0].tokens)
        await asyncio.sleep(0.2)
        still = len(engine._running[0].tokens)
        await engine.resume()
        out = (await task)[0][0]
        await engine.close()
        return held, still, out

    held, still, out = asyncio.run(go())
    expected = _generate(TorchEngine(model, tokenizer), prompt, params)[0][0]
    assert (held == still, held < 400) == (True, True)
    assert (out.token_ids, out.version_end) == (expected.token_ids, 0)


def test_weights_loaded_during_an_in_place_pause_show_in_version_end(model, tokenizer) -> None:
    prompt = _ids(tokenizer, ["Hi"])
    params = SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True)

    async def go():
        engine = TorchEngine(build_model(tokenizer, seed=0), tokenizer)
        task = asyncio.create_task(engine.generate(prompt, params))
        await _wait_tokens(engine, 5)
        await engine.pause("in_place")
        produced = len(engine._running[0].tokens)
        await engine.load_weights(build_model(tokenizer, seed=1).state_dict(), version=1)
        await engine.resume()
        out = (await task)[0][0]
        await engine.close()
        return out, produced

    out, produced = asyncio.run(go())
    old = _generate(TorchEngine(model, tokenizer), prompt, params)[0][0]
    assert (out.version_start, out.version_end) == (0, 1)
    assert out.token_ids[:produced] == old.token_ids[:produced]
    assert out.token_ids != old.token_ids


def test_pause_with_abort_returns_partial_responses_marked_abort(model, tokenizer) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=900, ignore_eos=True, n=2)

    async def go():
        engine = TorchEngine(model, tokenizer, max_batch_size=2)
        running = asyncio.create_task(engine.generate(_ids(tokenizer, ["Hi"]), params))
        await _wait_tokens(engine)
        queued = asyncio.create_task(engine.generate(_ids(tokenizer, ["Yo"]), params))
        await asyncio.sleep(0.01)
        aborted = await engine.pause("abort")
        results = await running, await queued
        state = await engine.status()
        await engine.resume()
        after = await engine.generate(_ids(tokenizer, ["Hi"]), params.with_(max_new_tokens=3))
        await engine.close()
        return aborted, results, state, after

    aborted, (running, queued), state, after = asyncio.run(go())
    assert aborted == 2
    assert {c.finish_reason for c in running[0] + queued[0]} == {"abort"}
    assert all(0 < len(c.token_ids) < 900 for c in running[0])
    assert [c.token_ids for c in queued[0]] == [[], []]
    assert (state.paused, state.running_requests) == (True, 0)
    assert [len(c.token_ids) for c in after[0]] == [3, 3]


def test_loading_unknown_or_misshapen_tensors_is_refused_and_changes_nothing(
    engine, tokenizer
) -> None:
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    good = next(iter(before))
    with pytest.raises(EngineRejected, match=r"unknown tensor names \['nope'\]"):
        asyncio.run(engine.load_weights({good: before[good] + 1, "nope": torch.zeros(1)}, 1))
    with pytest.raises(EngineRejected, match="wrong shapes"):
        asyncio.run(engine.load_weights({good: torch.zeros(3, 3)}, 1))
    after = engine.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.version == 0


def test_a_version_older_than_the_loaded_one_is_refused(model, tokenizer) -> None:
    engine = TorchEngine(build_model(tokenizer), tokenizer, version=5)
    with pytest.raises(EngineRejected, match="older than the loaded version 5"):
        asyncio.run(engine.load_weights(model.state_dict(), 4))


def test_weights_from_a_safetensors_folder_replace_the_model(tmp_path: Path, tokenizer) -> None:
    path = save_tiny_model(tmp_path / "v0", seed=0)
    new = save_tiny_model(tmp_path / "v3", seed=3)
    engine = TorchEngine.from_pretrained(path)
    reference = TorchEngine.from_pretrained(new)
    prompt = _ids(tokenizer, ["Hi"])
    params = SamplingParams(temperature=0, max_new_tokens=10)

    async def go():
        await engine.update_weights_from_disk(str(new), version=3)
        return await engine.generate(prompt, params)

    out = asyncio.run(go())[0][0]
    expected = _generate(reference, prompt, params)[0][0]
    asyncio.run(engine.close())
    assert (out.token_ids, out.version_start) == (expected.token_ids, 3)


def _lent_copy(model) -> dict[str, torch.Tensor]:
    """A version as EngineClient lends it: every tensor a view of one flat buffer."""
    state = model.state_dict()
    flat = torch.cat([t.reshape(-1) for t in state.values()])
    out, offset = {}, 0
    for name, t in state.items():
        out[name] = flat[offset : offset + t.numel()].view(t.shape)
        offset += t.numel()
    return out


def test_a_borrowed_load_serves_from_the_lent_tensors_without_copying(tokenizer) -> None:
    engine = TorchEngine(build_model(tokenizer, seed=0), tokenizer)
    lent = _lent_copy(build_model(tokenizer, seed=1))
    asyncio.run(engine.load_weights(lent, 1, borrow=True))
    params = engine.model.state_dict()
    assert all(params[k].data_ptr() == lent[k].data_ptr() for k in lent)


def test_a_borrowed_load_generates_like_a_copied_one(tokenizer) -> None:
    prompt = _ids(tokenizer, PROMPTS)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    borrowed = TorchEngine(build_model(tokenizer, seed=0), tokenizer)
    asyncio.run(borrowed.load_weights(_lent_copy(build_model(tokenizer, seed=1)), 1, borrow=True))
    copied = TorchEngine(build_model(tokenizer, seed=0), tokenizer)
    asyncio.run(copied.load_weights(build_model(tokenizer, seed=1).state_dict(), 1))
    out_b, out_c = _generate(borrowed, prompt, params), _generate(copied, prompt, params)
    assert [c[0].token_ids for c in out_b] == [c[0].token_ids for c in out_c]


def test_a_copied_load_after_a_borrowed_one_leaves_the_lenders_memory_alone(tokenizer) -> None:
    # The lender reuses its buffer for a later version: a copy must not land in it.
    engine = TorchEngine(build_model(tokenizer, seed=0), tokenizer)
    lent = _lent_copy(build_model(tokenizer, seed=1))
    kept = {k: v.clone() for k, v in lent.items()}
    asyncio.run(engine.load_weights(lent, 1, borrow=True))
    asyncio.run(engine.load_weights(build_model(tokenizer, seed=2).state_dict(), 2))
    assert all(torch.equal(lent[k], kept[k]) for k in lent)


def test_a_borrowed_load_of_another_dtype_is_copied(tokenizer) -> None:
    engine = TorchEngine(build_model(tokenizer, seed=0), tokenizer)
    lent = {k: v.to(torch.bfloat16) for k, v in _lent_copy(build_model(tokenizer, seed=1)).items()}
    asyncio.run(engine.load_weights(lent, 1, borrow=True))
    params = engine.model.state_dict()
    assert all(params[k].dtype == torch.float32 for k in lent)
    assert all(torch.equal(params[k], lent[k].float()) for k in lent)
