"""The simulated engine honours the engine interface and produces tokens at its set rate and
length distribution (the scale benchmark's replicas rest on both)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kuberl.common.config import JobConfig, SimulatedEngineConfig
from kuberl.rollout.engine import create_engine
from kuberl.rollout.engine.base import EngineRejected, SamplingParams
from kuberl.rollout.engine.simulated import SimulatedEngine


def engine(**kw: object) -> SimulatedEngine:
    return SimulatedEngine(SimulatedEngineConfig(**kw), seed=0)  # type: ignore[arg-type]


def test_the_job_file_names_it_and_create_engine_builds_it(tmp_path: Path) -> None:
    config = JobConfig.model_validate(
        {"rollout": {"engine": {"kind": "simulated", "tokens_per_second": 1000}}}
    )
    built = create_engine(config, tmp_path)
    assert isinstance(built, SimulatedEngine) and built.config.tokens_per_second == 1000


def test_a_batch_takes_as_long_as_its_longest_sample_at_the_set_rate() -> None:
    sim = engine(tokens_per_second=400, response_tokens=100, length_sigma=0)
    started = time.perf_counter()
    out = asyncio.run(sim.generate([[1, 2]] * 4, SamplingParams(n=2, max_new_tokens=512)))
    seconds = time.perf_counter() - started
    assert [len(c.token_ids) for row in out for c in row] == [100] * 8
    assert 0.25 <= seconds < 0.6  # 100 tokens at 400/s, sequences in parallel


def test_each_replica_draws_its_own_lengths_and_the_same_replica_the_same_again(
    tmp_path: Path,
) -> None:
    # Replicas that drew the same lengths finished every batch together and called the buffer
    # in waves of N calls (docs/scale.md).
    config = JobConfig.model_validate(
        {"job": {"seed": 7}, "rollout": {"engine": {"kind": "simulated", "length_sigma": 0.3}}}
    )

    def lengths(replica: str) -> list[int]:
        built = create_engine(config, tmp_path, replica)
        assert isinstance(built, SimulatedEngine)
        return built.lengths(64, max_new_tokens=4096).tolist()

    assert lengths("r0") == lengths("r0")
    assert len({tuple(lengths(f"r{i}")) for i in range(8)}) == 8


def test_lengths_follow_the_log_normal_around_the_median_and_respect_max_new_tokens() -> None:
    sim = engine(response_tokens=200, length_sigma=0.5)
    lengths = sim.lengths(20_000, max_new_tokens=100_000)
    assert abs(np.median(lengths) - 200) < 6
    assert abs(np.std(np.log(lengths)) - 0.5) < 0.02
    capped = sim.lengths(20_000, max_new_tokens=300)
    assert capped.max() == 300 and capped.min() >= 1


def test_completions_carry_logprobs_at_most_zero_tokens_in_vocab_and_the_version() -> None:
    sim = engine(tokens_per_second=1e6, response_tokens=50, vocab_size=10)
    asyncio.run(sim.load_weights({"w": torch.zeros(2)}, 3))
    [[c]] = asyncio.run(sim.generate([[1]], SamplingParams(max_new_tokens=400)))
    assert all(lp <= 0 for lp in c.logprobs) and len(c.logprobs) == len(c.token_ids)
    assert all(0 <= t < 10 for t in c.token_ids)
    assert (c.version_start, c.version_end) == (3, 3)


def test_a_sample_cut_at_max_new_tokens_finishes_by_length_else_by_stop() -> None:
    sim = engine(tokens_per_second=1e6, response_tokens=50, length_sigma=0)
    [[cut]] = asyncio.run(sim.generate([[1]], SamplingParams(max_new_tokens=30)))
    [[whole]] = asyncio.run(sim.generate([[1]], SamplingParams(max_new_tokens=60)))
    assert (cut.finish_reason, len(cut.token_ids)) == ("length", 30)
    assert (whole.finish_reason, len(whole.token_ids)) == ("stop", 50)


def test_pause_in_place_holds_generation_until_resume() -> None:
    async def run() -> tuple[float, str]:
        sim = engine(tokens_per_second=1000, response_tokens=100, length_sigma=0)
        task = asyncio.create_task(sim.generate([[1]], SamplingParams(max_new_tokens=200)))
        await asyncio.sleep(0.02)
        assert await sim.pause("in_place") == 0
        await asyncio.sleep(0.3)
        assert not task.done()  # 0.1 s of work, held by the pause
        paused_at = time.perf_counter()
        await sim.resume()
        [[c]] = await task
        return time.perf_counter() - paused_at, c.finish_reason

    after_resume, reason = asyncio.run(run())
    assert reason == "stop" and after_resume < 0.2


def test_pause_abort_ends_running_samples_with_abort_and_what_they_had() -> None:
    async def run() -> tuple[int, list[int], list[str]]:
        sim = engine(tokens_per_second=1000, response_tokens=1000, length_sigma=0)
        task = asyncio.create_task(sim.generate([[1]], SamplingParams(n=2, max_new_tokens=2000)))
        await asyncio.sleep(0.15)
        aborted = await sim.pause("abort")
        out = await task
        return aborted, [len(c.token_ids) for c in out[0]], [c.finish_reason for c in out[0]]

    aborted, lengths, reasons = asyncio.run(run())
    assert aborted == 1 and reasons == ["abort", "abort"]
    assert all(50 <= n < 1000 for n in lengths)


def test_a_load_mid_generation_shows_in_version_end() -> None:
    async def run() -> tuple[int, int]:
        sim = engine(tokens_per_second=1000, response_tokens=100, length_sigma=0)
        task = asyncio.create_task(sim.generate([[1]], SamplingParams(max_new_tokens=200)))
        await asyncio.sleep(0.02)
        await sim.load_weights([("w", torch.zeros(1))], 7)
        [[c]] = await task
        return c.version_start, c.version_end

    assert asyncio.run(run()) == (0, 7)


def test_older_weights_are_rejected_and_a_folder_without_safetensors_too(tmp_path: Path) -> None:
    sim = engine()
    asyncio.run(sim.load_weights({}, 5))
    with pytest.raises(EngineRejected, match="older than the loaded version 5"):
        asyncio.run(sim.load_weights({}, 4))
    with pytest.raises(EngineRejected, match="no \\*.safetensors"):
        asyncio.run(sim.update_weights_from_disk(str(tmp_path), 6))
    (tmp_path / "model.safetensors").write_bytes(b"")
    asyncio.run(sim.update_weights_from_disk(str(tmp_path), 6))
    assert sim.version == 6 and sim.loads == 2
