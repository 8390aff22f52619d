"""The built-in multi-turn rollout with the calculator tool, on the real torch engine.

A tiny Qwen2 is first trained (teacher forcing, about a second on CPU) to write one transcript:
a calculator call, then — after the tool response kuberl appends — the final answer. Greedy
rollouts then really call the tool, so the test checks the exact token layout: the model's
tokens with loss mask 1 and the engine's logprobs, the tool turn with loss mask 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kuberl.common.config import parse_job_config
from kuberl.rollout.engine.base import SamplingParams
from kuberl.rollout.engine.torch_engine import TorchEngine
from kuberl.rollout.functions import PromptItem, RolloutContext, load_rollout_function
from kuberl.rollout.multiturn import multi_turn_rollout
from kuberl.rollout.tools import format_tool_response
from tests.tiny_models import build_model, build_tokenizer

PROMPT = "What is 12*7?\n"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
FINAL = "The answer is 84."


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def train_tool_caller(tokenizer: Any) -> Any:
    """A tiny model that has memorised PROMPT + CALL + tool response + FINAL + EOS (also used by
    the integration test that runs multi-turn through a replica process and the buffer)."""
    model = build_model(tokenizer, hidden_size=64, layers=2, seed=0).train()
    text = PROMPT + CALL + format_tool_response("84") + FINAL
    ids = torch.tensor([[*tokenizer(text)["input_ids"], tokenizer.eos_token_id]])  # [1, T]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        logits = model(ids).logits[0, :-1]  # [T-1, V]
        loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:
            break
    assert loss.item() < 0.05, f"the model did not learn the transcript (loss {loss.item():.3f})"
    return model.eval()


@pytest.fixture(scope="module")
def model(tokenizer) -> Any:
    return train_tool_caller(tokenizer)


def _rollout(model, tokenizer, **multi_turn: Any) -> list[Any]:
    config = parse_job_config(
        {
            "rollout": {
                "group_size": 2,
                "multi_turn": {"enabled": True, "tools": ["calculator"], **multi_turn},
                "sampling": {"temperature": 0.0, "max_new_tokens": 200},
            }
        },
        env={},
    )

    async def go() -> list[Any]:
        engine = TorchEngine(model, tokenizer)
        ctx = RolloutContext(
            engine=engine,
            tokenizer=tokenizer,
            sampling=SamplingParams.from_config(config.rollout.sampling, n=2),
            config=config,
        )
        prompt = PromptItem("p", 0, PROMPT, "84", token_ids=tokenizer(PROMPT)["input_ids"])
        fn = load_rollout_function(config)
        try:
            return await fn(ctx, prompt)
        finally:
            await engine.close()

    return asyncio.run(go())


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_multi_turn_is_the_rollout_function_when_enabled() -> None:
    config = parse_job_config({"rollout": {"multi_turn": {"enabled": True}}}, env={})
    assert load_rollout_function(config) is multi_turn_rollout


def test_the_calculator_turn_is_appended_and_masked_out_of_the_loss(model, tokenizer) -> None:
    samples = _rollout(model, tokenizer)
    call, tool = _ids(tokenizer, CALL), _ids(tokenizer, format_tool_response("84"))
    final = [*_ids(tokenizer, FINAL), tokenizer.eos_token_id]
    for s in samples:
        assert s.token_ids == call + tool + final
        assert s.loss_mask == [1] * len(call) + [0] * len(tool) + [1] * len(final)
        assert (s.finish_reason, s.metadata["tool_calls"]) == (
            "stop",
            [{"turn": 0, "name": "calculator", "outcome": "ok"}],
        )


def test_the_tool_turn_follows_the_jobs_template(model, tokenizer) -> None:
    # A chat-style tool turn: the model's turn is closed and a new one opened around the output.
    template = (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|>\n"
    )
    template += "<|im_start|>assistant\n"
    samples = _rollout(model, tokenizer, tool_response_template=template)
    call = _ids(tokenizer, CALL)
    tool = _ids(tokenizer, template.replace("{output}", "84"))
    assert tokenizer.decode(tool).startswith("<|im_end|>")  # the special tokens are whole
    for s in samples:  # what the memorised model writes after an unfamiliar turn does not matter
        assert s.token_ids[: len(call) + len(tool)] == call + tool
        assert s.loss_mask[: len(call) + len(tool)] == [1] * len(call) + [0] * len(tool)
        assert set(s.loss_mask[len(call) + len(tool) :]) <= {1}


@pytest.mark.parametrize("template", ["no slot", "{output} twice {output}"])
def test_a_tool_response_template_needs_one_output_slot(template: str) -> None:
    with pytest.raises(ValueError, match="exactly once"):
        parse_job_config({"rollout": {"multi_turn": {"tool_response_template": template}}}, env={})


def test_logprobs_are_the_engines_on_model_tokens_and_zero_on_tool_tokens(model, tokenizer) -> None:
    s = _rollout(model, tokenizer)[0]
    prompt = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + s.token_ids])).logits[0]  # [P+R, V]
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(
        1, torch.tensor(s.token_ids)[:, None]
    )[:, 0]  # [R]
    model_pos = [i for i, keep in enumerate(s.loss_mask) if keep]
    tool_pos = [i for i, keep in enumerate(s.loss_mask) if not keep]
    assert [s.logprobs[i] for i in model_pos] == pytest.approx(ref[model_pos].tolist(), abs=1e-4)
    assert {s.logprobs[i] for i in tool_pos} == {0.0}


def test_the_turn_limit_ends_a_sample_that_still_calls_a_tool(model, tokenizer) -> None:
    s = _rollout(model, tokenizer, max_turns=1)[0]
    assert (s.token_ids, s.loss_mask, s.finish_reason) == (
        _ids(tokenizer, CALL),
        [1] * len(_ids(tokenizer, CALL)),
        "turn_limit",
    )


def test_the_response_budget_covers_all_turns_including_tool_output(model, tokenizer) -> None:
    budget = len(_ids(tokenizer, CALL)) + 5
    s = _rollout(model, tokenizer, max_total_tokens=budget)[0]
    assert (len(s.token_ids), s.finish_reason, s.loss_mask[-5:]) == (budget, "length", [0] * 5)


def test_a_context_grown_past_the_models_ends_the_sample_instead_of_failing_the_group(
    model, tokenizer
) -> None:
    # The call and its tool turn fill the model's context exactly: the engine refuses the next
    # turn. The sample ends there ("length"), where the refusal once failed the whole group.
    call, tool = _ids(tokenizer, CALL), _ids(tokenizer, format_tool_response("84"))
    context = len(tokenizer(PROMPT)["input_ids"]) + len(call) + len(tool)
    before = model.config.max_position_embeddings
    model.config.max_position_embeddings = context
    try:
        samples = _rollout(model, tokenizer)
    finally:
        model.config.max_position_embeddings = before
    for s in samples:
        assert (s.token_ids, s.loss_mask, s.finish_reason) == (
            call + tool,
            [1] * len(call) + [0] * len(tool),
            "length",
        )
