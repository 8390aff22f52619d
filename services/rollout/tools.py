"""Tools for multi-turn rollouts: the call format, a registry, and two example tools.

The model calls a tool by writing `<tool_call>{"name": "...", "arguments": {...}}</tool_call>`
(the Hermes / Qwen convention). `parse_tool_call` reads the first such call of a turn;
`ToolRegistry.run` executes it with a wall-clock limit and returns the text that is appended to
the sample as a tool turn (`format_tool_response`). Every failure — malformed JSON, an unknown
tool, an exception, a timeout — becomes a short error text for the model rather than a crash.

Built-in tools:
- `calculator`: arithmetic on numbers with + - * / // % ** and parentheses, evaluated from the
  Python AST (no `eval`), with limits on exponent and result size.
- `python`: runs a snippet in a fresh `python -I` subprocess in an empty temporary directory with
  a scrubbed environment and rlimits (CPU seconds, address space, file size, open files,
  processes) in its own process group, killed whole at the timeout; stdout and the last line of
  stderr come back truncated. It bounds resources only: it does not hide the file system or the
  network, so run rollout in a locked-down container when models execute untrusted code.
Custom tools are `module:function` taking the `arguments` dict and returning a string.
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
import operator
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kuberl.common.plugins import load_plugin
from kuberl.rollout import metrics as m

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)

ToolFn = Callable[[dict[str, Any]], str]


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


def format_tool_response(output: str) -> str:
    """The text appended after the model's `</tool_call>` (masked out of the loss)."""
    return f"\n<tool_response>\n{output}\n</tool_response>\n"


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
    """Evaluate an arithmetic expression safely; ValueError says what is not allowed."""
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


@dataclass
class PythonLimits:
    cpu_seconds: int = 5
    memory_bytes: int = 512 * 1024 * 1024
    file_bytes: int = 1024 * 1024
    open_files: int = 32
    processes: int = 16


# Runs first in the child interpreter: sets the limits, then executes the snippet (argv[1]).
# Limits are set here rather than in a preexec_fn, which is unsafe in a threaded parent.
_LAUNCHER = """
import resource, sys
for name, value in {limits!r}:
    resource.setrlimit(getattr(resource, name), (value, value))
source = sys.argv.pop(1)
exec(compile(source, "<tool>", "exec"), {{"__name__": "__main__"}})
"""


def run_python(
    code: str, *, timeout: float = 5.0, limits: PythonLimits | None = None, max_chars: int = 4096
) -> str:
    """Run code in a fresh isolated interpreter; its stdout (+ stderr on failure), truncated."""
    limits = limits or PythonLimits(cpu_seconds=max(1, math.ceil(timeout)))
    rlimits = [
        ("RLIMIT_CPU", limits.cpu_seconds),
        ("RLIMIT_AS", limits.memory_bytes),
        ("RLIMIT_FSIZE", limits.file_bytes),
        ("RLIMIT_NOFILE", limits.open_files),
        ("RLIMIT_NPROC", limits.processes),
    ]
    launcher = _LAUNCHER.format(limits=rlimits)
    with tempfile.TemporaryDirectory(prefix="kuberl-tool-") as cwd:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", launcher, code],
            cwd=cwd,
            env={"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, killed whole on timeout
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
            out = stdout.decode(errors="replace")
            return _truncate(out + f"\nTimeoutError: killed after {timeout:g}s", max_chars)
    out = stdout.decode(errors="replace").strip()
    if proc.returncode != 0:
        err = stderr.decode(errors="replace").strip().splitlines()
        out = (out + "\n" if out else "") + (err[-1] if err else f"exited with {proc.returncode}")
    return _truncate(out, max_chars)


def python_tool(arguments: dict[str, Any]) -> str:
    code = arguments.get("code", arguments.get("input"))
    if not isinstance(code, str):
        raise ValueError('python needs {"code": "<python source>"}')
    return run_python(code)


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 15] + "\n...[truncated]"


BUILTIN_TOOLS: dict[str, ToolFn] = {"calculator": calculator_tool, "python": python_tool}


class ToolRegistry:
    """The tools of a job (`rollout.multi_turn.tools`), run with a timeout and output limit."""

    def __init__(
        self, specs: Sequence[str], *, timeout_seconds: float = 5.0, max_output_chars: int = 1024
    ) -> None:
        self.tools: dict[str, ToolFn] = {}
        for spec in specs:
            if spec in BUILTIN_TOOLS:
                self.tools[spec] = BUILTIN_TOOLS[spec]
            else:
                fn = load_plugin(spec, kind="tool", params=["arguments"])
                self.tools[spec.rpartition(":")[2]] = fn
        self.timeout_seconds = timeout_seconds
        self.max_output_chars = max_output_chars

    async def run(self, call: ToolCall) -> tuple[str, str]:
        """(output text for the model, outcome: ok / error / timeout / bad_call)."""
        if call.error:
            outcome, text = "bad_call", f"error: {call.error}"
        elif call.name not in self.tools:
            outcome = "bad_call"
            text = f"error: unknown tool {call.name!r}; available: {', '.join(sorted(self.tools))}"
        else:
            try:
                result = await asyncio.wait_for(
                    asyncio.to_thread(self.tools[call.name], call.arguments),
                    self.timeout_seconds,
                )
                outcome, text = "ok", str(result)
            except TimeoutError:
                outcome, text = "timeout", f"error: {call.name} timed out"
            except Exception as exc:  # the tool's own failure is the model's feedback
                outcome, text = "error", f"error: {type(exc).__name__}: {exc}"
        m.TOOL_CALLS.labels(call.name or "<unparsed>", outcome).inc()
        return _truncate(text, self.max_output_chars), outcome
