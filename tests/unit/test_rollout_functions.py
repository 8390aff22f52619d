"""Rollout functions (`module:function` in the job file), prompt encoding, sampling parameters
and the backpressure trailer, as the rollout loop uses them."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
import torch

from kuberl.common.config import parse_job_config
from kuberl.common.plugins import PluginError
from kuberl.rollout.engine.base import SamplingParams
from kuberl.rollout.engine.torch_engine import TorchEngine
from kuberl.rollout.functions import (
    PromptItem,
    RolloutContext,
    RolloutSample,
    default_rollout,
    encode_prompt,
    load_rollout_function,
)
from kuberl.rollout.worker import retry_after
from tests.tiny_models import build_model, build_tokenizer

MOD = "tests.unit.test_rollout_functions"


async def twice_rollout(context: RolloutContext, prompt: PromptItem) -> list[RolloutSample]:
    """A custom rollout: each sample is two greedy generations of 2 tokens, concatenated."""
    params = context.sampling.with_(n=1, temperature=0.0, max_new_tokens=2)
    samples = []
    for _ in range(context.group_size):
        [[a]] = await context.engine.generate([prompt.token_ids], params)
        [[b]] = await context.engine.generate([prompt.token_ids + a.token_ids], params)
        samples.append(
            RolloutSample(
                a.token_ids + b.token_ids, a.logprobs + b.logprobs, metadata={"custom": True}
            )
        )
    return samples


def sync_rollout(context: Any, prompt: Any) -> list[RolloutSample]:
    return []


def _config(**rollout: Any):
    return parse_job_config({"rollout": {"group_size": 2, **rollout}}, env={})


def test_a_custom_rollout_function_is_loaded_and_drives_the_engine() -> None:
    tokenizer = build_tokenizer()
    config = _config(rollout_function=f"{MOD}:twice_rollout")
    fn = load_rollout_function(config)

    async def go() -> list[RolloutSample]:
        engine = TorchEngine(build_model(tokenizer), tokenizer)
        ctx = RolloutContext(engine, tokenizer, SamplingParams(n=2), config)
        try:
            return await fn(ctx, PromptItem("p", 0, "Hi", "", token_ids=[5, 6, 7]))
        finally:
            await engine.close()

    samples = asyncio.run(go())
    assert fn is twice_rollout
    assert [(len(s.token_ids), s.metadata) for s in samples] == [(4, {"custom": True})] * 2


def test_a_rollout_function_must_be_async() -> None:
    with pytest.raises(PluginError, match=r"must be `async def sync_rollout\(context, prompt\)`"):
        load_rollout_function(_config(rollout_function=f"{MOD}:sync_rollout"))


def test_a_rollout_function_with_the_wrong_signature_is_refused() -> None:
    with pytest.raises(PluginError, match="kuberl calls it as"):
        load_rollout_function(_config(rollout_function=f"{MOD}:_config"))


def test_the_default_rollout_draws_n_samples_in_one_engine_call() -> None:
    tokenizer = build_tokenizer()
    config = _config()

    async def go() -> list[RolloutSample]:
        engine = TorchEngine(build_model(tokenizer), tokenizer)
        params = SamplingParams(n=3, max_new_tokens=4, ignore_eos=True)
        ctx = RolloutContext(engine, tokenizer, params, config)
        try:
            return await default_rollout(ctx, PromptItem("p", 0, "Hi", "", token_ids=[5, 6]))
        finally:
            await engine.close()

    torch.manual_seed(0)
    samples = asyncio.run(go())
    assert [(len(s.token_ids), s.loss_mask, s.finish_reason) for s in samples] == [
        (4, None, "length")
    ] * 3


def test_prompts_use_the_chat_template_only_when_asked() -> None:
    tokenizer = build_tokenizer()
    plain = encode_prompt(tokenizer, "Hi", chat_template=False)
    chat = encode_prompt(tokenizer, "Hi", chat_template=True)
    assert tokenizer.decode(plain) == "Hi"
    assert tokenizer.decode(chat) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


# A chat template that renders tools= (as Qwen2.5's and Hermes' do, in our own words).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "\nCall one as <tool_call>{...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_tools_schemas_reach_the_chat_template_of_a_multi_turn_replica() -> None:
    from kuberl.rollout.worker import RolloutWorker

    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE

    def prompt(**multi_turn: Any) -> str:
        config = parse_job_config(
            {"model": {"chat_template": True}, "rollout": {"multi_turn": multi_turn}}, env={}
        )
        worker = RolloutWorker(
            config,
            None,
            tokenizer,
            buffer=None,
            reward=None,
            replica_id="r0",  # type: ignore[arg-type]
        )
        ids = encode_prompt(tokenizer, "Hi", True, worker._tool_schemas)
        return str(tokenizer.decode(ids))

    chat = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    described = prompt(enabled=True, tools=["calculator"])
    assert described.startswith("<|im_start|>system\nTools:{") and described.endswith(chat)
    assert '"name": "calculator"' in described and '"required": ["expression"]' in described
    assert prompt(enabled=True, tools=["calculator"], describe_tools=False) == chat
    assert prompt(enabled=False) == chat  # no tools without multi-turn


def test_sampling_parameters_come_from_the_job_with_the_group_size_as_n() -> None:
    config = parse_job_config(
        {"rollout": {"group_size": 4, "sampling": {"top_k": 5, "stop": ["\n\n"]}}}, env={}
    )
    params = SamplingParams.from_config(config.rollout.sampling, n=config.rollout.group_size)
    assert (params.n, params.top_k, params.stop) == (4, 5, ("\n\n",))


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"top_p": 0.0}, "top_p must be in"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"n": 0}, "n must be >= 1"),
        ({"stop": ("",)}, "stop strings must not be empty"),
    ],
)
def test_invalid_sampling_parameters_name_the_problem(kw: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        SamplingParams(**kw)


def _rpc_error(trailer: tuple[tuple[str, str], ...]) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*trailer),
        "busy",
    )


def test_the_retry_after_trailer_sets_the_backpressure_wait() -> None:
    assert retry_after(_rpc_error((("retry-after-seconds", "1.500"),)), 9.0) == 1.5
    assert retry_after(_rpc_error(()), 9.0) == 9.0
    assert retry_after(_rpc_error((("retry-after-seconds", "soon"),)), 9.0) == 9.0


def test_each_response_is_decoded_once_for_the_reward_and_the_trajectory() -> None:
    from kuberl.api.reward.v1 import reward_pb2 as rpb
    from kuberl.rollout.worker import RolloutWorker

    tokenizer = build_tokenizer()
    config = _config(sampling={"max_new_tokens": 4})
    decoded: list[list[int]] = []
    decode = tokenizer.decode

    def counting_decode(ids: Any, **kw: Any) -> Any:
        decoded.append(list(ids))
        return decode(ids, **kw)

    async def go() -> tuple[Any, Any]:
        engine = TorchEngine(build_model(tokenizer), tokenizer)
        worker = RolloutWorker(config, engine, tokenizer, buffer=None, reward=None, replica_id="r0")
        tokenizer.decode = counting_decode
        try:
            done = await worker._generate_group(
                PromptItem("p", 0, "Hi", "1", token_ids=[5, 6], lease_id="L"), 0.0
            )
        finally:
            await engine.close()
        assert done is not None
        scores = {f"L#{j}": rpb.SampleScore(sample_id=f"L#{j}", reward=1.0) for j in range(2)}
        return done, worker._group(done, scores, 0.0, "train")

    done, group = asyncio.run(go())
    assert [t.response_text for t in group.trajectories] == done.texts
    assert decoded == [s.token_ids for s in done.samples]  # one decode per sample, not two
