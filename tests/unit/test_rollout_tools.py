"""Tool calling for multi-turn rollouts: the call format, the calculator, the python sandbox and
the registry that turns every failure into feedback for the model."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kuberl.common.plugins import PluginError
from kuberl.rollout import metrics as m
from kuberl.rollout.tools import (
    TOOL_THREADS,
    ToolCall,
    ToolRegistry,
    calculate,
    calculator_tool,
    format_tool_response,
    parse_tool_call,
    run_python,
)

MOD = "tests.unit.test_rollout_tools"


def slow_tool(arguments: dict) -> str:
    time.sleep(1)  # a thread cannot be killed: the registry stops waiting at its timeout
    return "too late"


def echo_tool(arguments: dict) -> str:
    return f"echo {arguments['text']}"


RELEASE_HUNG = threading.Event()


def hung_tool(arguments: dict) -> str:
    RELEASE_HUNG.wait(30)  # a tool that never returns (until the test lets it)
    return "hung"


def test_a_tool_call_is_parsed_from_the_text_around_it() -> None:
    call = '{"name": "calculator", "arguments": {"expression": "1+2"}}'
    text = f"Let me compute. <tool_call>{call}</tool_call> and wait."
    assert parse_tool_call(text) == ToolCall("calculator", {"expression": "1+2"})


def test_text_without_a_tool_call_has_none() -> None:
    assert parse_tool_call("The answer is 3. <tool_call> never closed") is None


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("{not json", "not valid JSON"),
        ('{"arguments": {}}', 'must be {"name"'),
        ('{"name": "calculator", "arguments": [1]}', "arguments must be a JSON object"),
    ],
)
def test_a_malformed_tool_call_is_reported_not_raised(body: str, error: str) -> None:
    call = parse_tool_call(f"<tool_call>{body}</tool_call>")
    assert call is not None and error in call.error


def test_double_encoded_arguments_are_decoded() -> None:
    call = parse_tool_call('<tool_call>{"name": "c", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert call == ToolCall("c", {"x": 1})


@pytest.mark.parametrize(
    ("expression", "value"),
    [("12*7", 84), ("2+3*4", 14), ("7/2", 3.5), ("2^10", 1024), ("-(1+2)**3", -27), ("7//2", 3)],
)
def test_the_calculator_evaluates_arithmetic(expression: str, value: float) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("2 ** 1000", "exponent larger than 100"),
        ("1/0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
    ],
)
def test_the_calculator_refuses_anything_but_arithmetic(expression: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        calculate(expression)


def test_calculator_output_is_plain_text() -> None:
    outputs = [calculator_tool({"expression": e}) for e in ("6*7", "1/3")]
    assert outputs == ["42", "0.3333333333"]


def test_python_runs_in_an_empty_directory_with_a_scrubbed_environment() -> None:
    code = "import os; print(len(os.listdir('.')), sorted(k for k in os.environ if 'KUBERL' in k))"
    assert run_python(code) == "0 []"


def test_python_is_killed_at_its_timeout() -> None:
    # A busy loop meets the 1 s wall clock and its 1 s CPU limit at about the same moment; on a
    # loaded machine either may end it, and both say so.
    started = time.monotonic()
    out = run_python("while True: pass", timeout=1.0)
    assert out in ("TimeoutError: killed after 1s", "TimeoutError: used its 1s of CPU time")
    assert time.monotonic() - started < 4


def test_python_memory_is_limited() -> None:
    assert run_python("x = bytearray(2 * 1024**3)").endswith("MemoryError")


def test_python_errors_come_back_as_the_last_line_of_stderr() -> None:
    assert run_python("print('partial'); 1/0") == "partial\nZeroDivisionError: division by zero"


def _run(registry: ToolRegistry, call: ToolCall) -> tuple[str, str]:
    return asyncio.run(registry.run(call))


def test_the_registry_runs_builtin_and_custom_tools() -> None:
    registry = ToolRegistry(["calculator", f"{MOD}:echo_tool"])
    assert _run(registry, ToolCall("calculator", {"expression": "2*21"})) == ("42", "ok")
    assert _run(registry, ToolCall("echo_tool", {"text": "hi"})) == ("echo hi", "ok")


def test_an_unknown_tool_is_answered_with_the_available_ones() -> None:
    before = m.TOOL_CALLS.labels("<unknown>", "bad_call")._value.get()
    text, outcome = _run(ToolRegistry(["calculator"]), ToolCall("search", {}))
    assert (text, outcome) == ("error: unknown tool 'search'; available: calculator", "bad_call")
    # Counted under one label: names the model makes up never become series of their own.
    seen = {s.labels["tool"] for metric in m.TOOL_CALLS.collect() for s in metric.samples}
    assert m.TOOL_CALLS.labels("<unknown>", "bad_call")._value.get() == before + 1
    assert "search" not in seen


def test_a_failing_tool_becomes_an_error_message_and_is_counted() -> None:
    before = m.TOOL_CALLS.labels("calculator", "error")._value.get()
    text, outcome = _run(
        ToolRegistry(["calculator"]), ToolCall("calculator", {"expression": "1/0"})
    )
    after = m.TOOL_CALLS.labels("calculator", "error")._value.get()
    assert (text, outcome, after - before) == ("error: ValueError: division by zero", "error", 1)


def test_a_slow_tool_times_out() -> None:
    registry = ToolRegistry([f"{MOD}:slow_tool"], timeout_seconds=0.2)
    assert _run(registry, ToolCall("slow_tool", {})) == ("error: slow_tool timed out", "timeout")


def test_tools_that_hang_never_take_the_threads_the_engine_needs() -> None:
    # More hung calls than the event loop's default executor has threads: each times out, and
    # the default executor (the torch engine's pause and weight loads) still runs at once.
    registry = ToolRegistry([f"{MOD}:hung_tool"], timeout_seconds=0.2)

    async def scenario() -> tuple[list[tuple[str, str]], float]:
        # A default executor smaller than the hung calls, whatever this machine's CPU count.
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(4))
        calls = [registry.run(ToolCall("hung_tool", {})) for _ in range(TOOL_THREADS + 4)]
        outcomes = await asyncio.gather(*calls)
        started = time.monotonic()
        await asyncio.wait_for(asyncio.to_thread(lambda: None), 5)
        return outcomes, time.monotonic() - started

    try:
        outcomes, waited = asyncio.run(scenario())
    finally:
        RELEASE_HUNG.set()
        registry.close()
    assert {o for _, o in outcomes} == {"timeout"} and len(outcomes) == TOOL_THREADS + 4
    assert waited < 1.0


def test_long_tool_output_is_truncated() -> None:
    registry = ToolRegistry([f"{MOD}:echo_tool"], max_output_chars=32)
    text, _ = _run(registry, ToolCall("echo_tool", {"text": "x" * 100}))
    assert (len(text), text.endswith("...[truncated]")) == (32, True)


def test_a_tool_that_cannot_be_loaded_fails_at_start() -> None:
    with pytest.raises(PluginError, match="module 'no_such_module' not found"):
        ToolRegistry(["no_such_module:tool"])


def test_the_tool_response_format_is_documented() -> None:
    assert format_tool_response("84") == "\n<tool_response>\n84\n</tool_response>\n"


def lookup_tool(arguments: dict) -> str:
    """Look a word up in the dictionary.

    Arguments: {"word": ...}."""
    return "a definition"


def schema_tool(arguments: dict) -> str:
    return "ok"


schema_tool.tool_schema = {  # type: ignore[attr-defined]
    "type": "function",
    "function": {"name": "schema_tool", "parameters": {"type": "object", "properties": {}}},
}


def test_every_tool_has_a_schema_a_chat_template_can_render() -> None:
    registry = ToolRegistry(["calculator", "python", f"{MOD}:lookup_tool", f"{MOD}:schema_tool"])
    schemas = registry.schemas()
    registry.close()
    functions = [s["function"] for s in schemas]
    assert [f["name"] for f in functions] == ["calculator", "python", "lookup_tool", "schema_tool"]
    assert functions[0]["parameters"]["required"] == ["expression"]
    assert functions[1]["parameters"]["required"] == ["code"]
    # A custom function's first docstring paragraph; its own `tool_schema` when it has one.
    assert functions[2]["description"] == "Look a word up in the dictionary."
    assert schemas[3] is schema_tool.tool_schema  # type: ignore[attr-defined]
    # The built-ins' argument names are the ones the tools read.
    assert calculator_tool({"expression": "6*7"}) == "42"
