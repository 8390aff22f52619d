"""The built-in multi-turn rollout: the model calls tools, their outputs become tool turns.

`kuberl.rollout.functions` makes `multi_turn_rollout` the rollout function when
`rollout.multi_turn.enabled` is set. Each sample is at most `multi_turn.max_turns` model turns; a
turn that closes a `<tool_call>` runs the tool (`kuberl.rollout.tools`) and its output, tokenized on
its own, is appended as a tool turn. The response is model tokens (loss mask 1, the engine's
logprobs, never re-tokenized) and tool tokens (loss mask 0, logprob 0): the model is trained on what
it wrote, never on what the tools wrote.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kuberl.rollout.engine.base import EngineRejected
from kuberl.rollout.functions import PromptItem, RolloutContext, RolloutSample
from kuberl.rollout.tools import (
    TOOL_CALL_CLOSE,
    ToolRegistry,
    format_tool_response,
    parse_tool_call,
)


def tool_registry(ctx: RolloutContext) -> ToolRegistry:
    if ctx.tools is None:
        ctx.tools = ToolRegistry.from_config(ctx.config.rollout.multi_turn)
    tools: ToolRegistry = ctx.tools
    return tools


async def multi_turn_rollout(ctx: RolloutContext, prompt: PromptItem) -> list[RolloutSample]:
    """n tool-using samples of one prompt, run concurrently (the engine batches their turns).

    A sample ends with its last turn's finish reason when that turn calls no tool; "length" when
    the response budget (`multi_turn.max_total_tokens`, default `sampling.max_new_tokens`) is
    used up or the engine refuses a later turn's context (longer than the model's);
    "turn_limit" when the last allowed turn still calls a tool; "abort" when the engine aborted
    a turn. Metadata records the tool calls and their outcomes.
    """
    tools = tool_registry(ctx)
    return list(
        await asyncio.gather(*(_one_sample(ctx, tools, prompt) for _ in range(ctx.group_size)))
    )


async def _one_sample(
    ctx: RolloutContext, tools: ToolRegistry, prompt: PromptItem
) -> RolloutSample:
    mt = ctx.config.rollout.multi_turn
    budget = mt.max_total_tokens or ctx.sampling.max_new_tokens
    stops = tuple(dict.fromkeys((*ctx.sampling.stop, TOOL_CALL_CLOSE)))
    tokens: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    calls: list[dict[str, Any]] = []
    version_start: int | None = None
    version_end = 0
    queue_seconds = 0.0
    finish = "length"
    for turn in range(mt.max_turns):
        left = budget - len(tokens)
        if left <= 0:
            finish = "length"
            break
        params = ctx.sampling.with_(n=1, stop=stops, max_new_tokens=left)
        try:
            [[c]] = await ctx.engine.generate([prompt.token_ids + tokens], params)
        except EngineRejected:
            if not tokens:
                raise  # the prompt itself is refused: the group fails
            # The context (prompt, turns, tool output) no longer fits the model: this sample ends
            # here, as one cut at its budget, instead of failing its whole group.
            finish = "length"
            break
        version_start = c.version_start if version_start is None else version_start
        version_end = c.version_end
        queue_seconds += c.engine_queue_seconds
        tokens += c.token_ids
        logprobs += c.logprobs
        mask += [1] * len(c.token_ids)
        finish = c.finish_reason
        if c.finish_reason == "abort":
            break
        call = parse_tool_call(ctx.decode(c.token_ids)) if c.finish_reason == "stop" else None
        if call is None:
            break
        if turn == mt.max_turns - 1:
            finish = "turn_limit"
            break
        output, outcome = await tools.run(call)
        calls.append({"turn": turn, "name": call.name, "outcome": outcome})
        response = format_tool_response(output, mt.tool_response_template)
        tool_ids = ctx.encode(response)[: max(0, budget - len(tokens))]
        tokens += tool_ids
        logprobs += [0.0] * len(tool_ids)
        mask += [0] * len(tool_ids)
        finish = "length"  # if the budget ends here, the sample was cut short
    return RolloutSample(
        token_ids=tokens,
        logprobs=logprobs,
        finish_reason=finish,
        loss_mask=mask,
        version_start=version_start if version_start is not None else ctx.engine.version,
        version_end=version_end if version_start is not None else ctx.engine.version,
        metadata={"tool_calls": calls, "turns": len(calls) + 1},
        engine_queue_seconds=queue_seconds,
    )
