"""Tools for multi-turn rollouts: the call format, a registry, and two built-in tools.

`kuberl.rollout.multiturn` calls them. The model calls a tool by writing
`<tool_call>{"name": "...", "arguments": {...}}</tool_call>` (the Hermes / Qwen convention);
`parse_tool_call` reads the first call of a turn and `ToolRegistry.run` executes it with a
timeout, returning the tool turn's text (`format_tool_response`). Every failure (malformed JSON,
an unknown tool, an exception, a timeout) becomes a short error text for the model, never a
crash. Built in: `calculator` (arithmetic from the AST, no `eval`) and `python` (a snippet in
`kuberl.common.sandbox`); a job may add `module:function` tools. Details: docs/rollout.md,
"Multi-turn tool calling".
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import re
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kuberl.common.config import TOOL_RESPONSE_TEMPLATE, MultiTurnConfig, SandboxConfig
from kuberl.common.logs import get_logger
from kuberl.common.plugins import load_plugin
from kuberl.common.sandbox import FULL_ISOLATION, Sandbox, SandboxError
from kuberl.rollout import metrics as m

log = get_logger(__name__)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)

ToolFn = Callable[[dict[str, Any]], str]
AsyncToolFn = Callable[[dict[str, Any]], Awaitable[str]]


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str = ""  # set when the call could not be parsed; name may then be ""


def parse_tool_call(text: str) -> ToolCall | None:
    """The first `<tool_call>{json}</tool_call>` in text; None when there is none."""
    match = _CALL.search(text)
    if match is None:
        return None
    raw = match.group(1).strip()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ToolCall("", {}, f"tool call is not valid JSON ({exc.msg} at {exc.pos})")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall("", {}, 'tool call must be {"name": "...", "arguments": {...}}')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = {"input": arguments}
    if not isinstance(arguments, dict):
        return ToolCall(data["name"], {}, "tool call arguments must be a JSON object")
    return ToolCall(data["name"], arguments)


def format_tool_response(output: str, template: str = TOOL_RESPONSE_TEMPLATE) -> str:
    """The text appended after the model's `</tool_call>` (masked out of the loss): the job's
    `multi_turn.tool_response_template` with the output in place of `{output}`."""
    return template.replace("{output}", output)


# -- calculator --------------------------------------------------------------------------------

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_MAGNITUDE = 1e100


def calculate(expression: str) -> float | int:
    """Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses) from its
    AST, never `eval`, with bounds on exponent and result size; ValueError says what is not
    allowed."""
    if len(expression) > 500:
        raise ValueError("expression is longer than 500 characters")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def ev(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, int | float) and not isinstance(value, bool):
                return value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent larger than 100")
            result = _BINARY[type(node.op)](left, right)
            if isinstance(result, complex) or abs(result) > _MAX_MAGNITUDE:
                raise ValueError("result out of range")
            return result
        raise ValueError(f"{type(node).__name__} is not allowed; use numbers and + - * / // % **")

    try:
        value = ev(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def calculator_tool(arguments: dict[str, Any]) -> str:
    expression = arguments.get("expression", arguments.get("input"))
    if not isinstance(expression, str):
        raise ValueError('calculator needs {"expression": "<arithmetic>"}')
    value = calculate(expression)
    if isinstance(value, float) and math.isfinite(value):
        return repr(round(value, 10))
    return str(value)


# -- python sandbox ----------------------------------------------------------------------------

# Seconds the sandbox launcher gets beyond the program's wall clock to set up its namespaces and
# report back.
LAUNCH_SECONDS = 2.0


class ToolTimeout(Exception):
    """A tool ran out of time; `text` is what the model is shown (partial output included)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


class PythonTool:
    """The `python` tool: runs a snippet in `kuberl.common.sandbox` and answers its stdout (and
    the last line of stderr when it fails), truncated to `max_chars`.

    Each call is a fresh `python -I -S` in its own sandbox run: a new network namespace, a
    private /tmp holding its empty working directory, a dedicated uid, rlimits and a scrubbed
    environment where the host allows them (the fallbacks are the reward sandbox's, see
    docs/reward.md). The program gets `timeout` seconds of wall clock once a sandbox slot is
    free; then everything it started is killed and the call raises `ToolTimeout`.
    """

    def __init__(
        self,
        config: SandboxConfig,
        *,
        timeout: float,
        max_chars: int = 4096,
        setting: str = "rollout.multi_turn.sandbox",
    ) -> None:
        self.config = config
        self.timeout = min(timeout, config.wall_seconds)
        self.max_chars = max_chars
        self.sandbox = Sandbox(config, setting=setting)
        self._started = False
        self._starting = asyncio.Lock()

    async def start(self) -> dict[str, str]:
        """Probe the sandbox once: log and export its isolation; with `require_isolation`,
        RuntimeError unless it has its own network namespace and a dedicated uid."""
        async with self._starting:
            if not self._started:
                await self._probe()
                self._started = True
        return self.sandbox.isolation

    async def _probe(self) -> None:
        isolation = await self.sandbox.probe()
        for aspect, good in FULL_ISOLATION.items():
            m.TOOL_SANDBOX_ISOLATED.labels(aspect).set(float(isolation.get(aspect) == good))
        if self.sandbox.fully_isolated:
            log.info("tool.python.isolation", **isolation)
        elif self.config.require_isolation:
            raise RuntimeError(
                f"{self.sandbox.setting}.require_isolation is set but the python tool's sandbox "
                f"only gets {isolation} here (needs root, network and mount namespaces)"
            )
        else:
            log.warning("tool.python.weak_isolation", **isolation)

    async def __call__(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code", arguments.get("input"))
        if not isinstance(code, str):
            raise ValueError('python needs {"code": "<python source>"}')
        await self.start()
        try:
            out = await self.sandbox.execute(
                code, timeout=self.timeout + LAUNCH_SECONDS, wall_seconds=self.timeout
            )
        except SandboxError as exc:
            if exc.reason == "timeout":
                raise ToolTimeout(f"TimeoutError: killed after {self.timeout:g}s") from None
            raise RuntimeError(exc.message) from None
        text = out.stdout.strip()
        if out.status == "timeout":
            tail = f"TimeoutError: killed after {self.timeout:g}s"
            if out.detail.startswith("used its"):
                tail = f"TimeoutError: {out.detail}"
            raise ToolTimeout(_truncate(f"{text}\n{tail}" if text else tail, self.max_chars))
        if out.status == "output_limit":
            text += f"\nerror: output cut off ({out.detail})"
        elif out.returncode != 0:
            err = out.stderr.strip().splitlines()
            last = err[-1] if err else f"exited with {out.returncode}"
            text = f"{text}\n{last}" if text else last
        return _truncate(text, self.max_chars)

    def close(self) -> None:
        self.sandbox.close()


def run_python(
    code: str,
    *,
    timeout: float = 5.0,
    config: SandboxConfig | None = None,
    max_chars: int = 4096,
) -> str:
    """Run code once in a fresh sandbox and return what the `python` tool would answer (a
    timeout included); for scripts and tests, the rollout keeps one `PythonTool`."""
    tool = PythonTool(
        config or SandboxConfig(cpu_seconds=max(1, math.ceil(timeout)), max_concurrent=1),
        timeout=timeout,
        max_chars=max_chars,
    )
    try:
        return asyncio.run(tool({"code": code}))
    except ToolTimeout as exc:
        return exc.text
    finally:
        tool.close()


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 15] + "\n...[truncated]"


BUILTIN_TOOLS: dict[str, ToolFn] = {"calculator": calculator_tool}


def _schema(name: str, description: str, arguments: dict[str, str]) -> dict[str, Any]:
    """A tool in the OpenAI function format that chat templates render (`tools=` of
    `apply_chat_template`): every argument a required string."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    k: {"type": "string", "description": v} for k, v in arguments.items()
                },
                "required": list(arguments),
            },
        },
    }


BUILTIN_SCHEMAS: dict[str, dict[str, Any]] = {
    "calculator": _schema(
        "calculator",
        "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses) and "
        "return its value.",
        {"expression": "The expression, e.g. (12 + 7) * 3"},
    ),
    "python": _schema(
        "python",
        "Run a Python program (standard library only, no network) and return what it prints "
        "(and the last line of the error when it fails).",
        {"code": "The program; print the result."},
    ),
}


def tool_schema(name: str, fn: Any) -> dict[str, Any]:
    """The schema a chat template shows the model for one tool (passed as `tools=` with
    `model.chat_template` and `multi_turn.describe_tools`, which is how Qwen2.5 / Hermes templates
    teach the tools and the `<tool_call>` format): a built-in's own, a custom function's
    `tool_schema` attribute when it has one, else its name and docstring with free-form
    arguments."""
    if name in BUILTIN_SCHEMAS:
        return BUILTIN_SCHEMAS[name]
    schema = getattr(fn, "tool_schema", None)
    if isinstance(schema, dict):
        return schema
    doc = inspect.getdoc(fn) or f"The {name} tool."
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": doc.split("\n\n")[0].replace("\n", " "),
            "parameters": {"type": "object", "properties": {}},
        },
    }


#: Threads for plain-function tools: calls beyond this many at once wait (within their timeout).
TOOL_THREADS = 16


class ToolRegistry:
    """The tools of a job (`rollout.multi_turn.tools`), run with a timeout and output limit.
    A custom tool is `module:function` taking the `arguments` dict and returning a string, or an
    `async def` doing so.

    Plain functions run in a thread of the registry's own pool (at the timeout the registry
    stops waiting, but a thread cannot be killed: a tool that hangs keeps one of the pool's
    `TOOL_THREADS`, never one of the event loop's default executor, which the engine's pause and
    weight loads need); `async def` tools are cancelled at the timeout; the `python` tool keeps
    its own wall clock, counted once its sandbox slot is free.
    """

    def __init__(
        self,
        specs: Sequence[str],
        *,
        timeout_seconds: float = 5.0,
        max_output_chars: int = 1024,
        sandbox: SandboxConfig | None = None,
    ) -> None:
        self.tools: dict[str, ToolFn | AsyncToolFn] = {}
        self.python: PythonTool | None = None
        for spec in specs:
            if spec == "python":
                self.python = PythonTool(
                    sandbox or SandboxConfig(),
                    timeout=timeout_seconds,
                    max_chars=max_output_chars,
                )
                self.tools[spec] = self.python
            elif spec in BUILTIN_TOOLS:
                self.tools[spec] = BUILTIN_TOOLS[spec]
            else:
                fn = load_plugin(spec, kind="tool", params=["arguments"])
                self.tools[spec.rpartition(":")[2]] = fn
        self.timeout_seconds = timeout_seconds
        self.max_output_chars = max_output_chars
        self._threads = ThreadPoolExecutor(TOOL_THREADS, thread_name_prefix="tool")

    @classmethod
    def from_config(cls, config: MultiTurnConfig) -> ToolRegistry:
        return cls(
            config.tools,
            timeout_seconds=config.tool_timeout_seconds,
            max_output_chars=config.max_tool_output_chars,
            sandbox=config.sandbox,
        )

    def schemas(self) -> list[dict[str, Any]]:
        """Every tool's schema, in the job's order (`tool_schema`)."""
        return [tool_schema(name, fn) for name, fn in self.tools.items()]

    async def start(self) -> None:
        """Probe the python tool's sandbox (when the job uses it) before the first call."""
        if self.python is not None:
            await self.python.start()

    def close(self) -> None:
        if self.python is not None:
            self.python.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def _call(self, name: str, arguments: dict[str, Any]) -> Any:
        fn = self.tools[name]
        if fn is self.python:
            return await self.python(arguments)
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(arguments), self.timeout_seconds)
        call = asyncio.get_running_loop().run_in_executor(self._threads, fn, arguments)
        return await asyncio.wait_for(call, self.timeout_seconds)

    async def run(self, call: ToolCall) -> tuple[str, str]:
        """(output text for the model, outcome: ok / error / timeout / bad_call)."""
        if call.error:
            outcome, text = "bad_call", f"error: {call.error}"
        elif call.name not in self.tools:
            outcome = "bad_call"
            text = f"error: unknown tool {call.name!r}; available: {', '.join(sorted(self.tools))}"
        else:
            try:
                outcome, text = "ok", str(await self._call(call.name, call.arguments))
            except ToolTimeout as exc:
                outcome, text = "timeout", exc.text
            except TimeoutError:
                outcome, text = "timeout", f"error: {call.name} timed out"
            except Exception as exc:  # the tool's own failure is the model's feedback
                outcome, text = "error", f"error: {type(exc).__name__}: {exc}"
        # The label is a tool of the job's, never a name the model made up (unbounded series).
        label = call.name if call.name in self.tools else "<unknown>" if call.name else "<unparsed>"
        m.TOOL_CALLS.labels(label, outcome).inc()
        return _truncate(text, self.max_output_chars), outcome
