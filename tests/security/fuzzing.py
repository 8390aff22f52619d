"""Hypothesis strategies for hostile gRPC requests, and a raw caller that records status codes.

`messages(descriptor)` draws any message of a proto type from its descriptor: integers at their
extremes (huge n, negative sizes), every float NaN / +-inf / subnormal / huge, unknown enum
values (proto3 enums are open), odd strings (paths, `module:function`, control characters, long
text), random bytes, nested messages, repeated fields and maps. `tensors()` draws
`kuberl.common.v1.Tensor`s whose dtype, shape and byte length disagree in every way.
`RawCaller` sends bytes exactly as given (no client-side serialization), so undecodable requests
reach the server too.

`KUBERL_FUZZ_EXAMPLES=N` runs every fuzz test with N examples (default: each test's own small
count, sized for CI); `KUBERL_FUZZ_SEED=S` makes a random run from seed S (default:
derandomized, so CI is stable); `KUBERL_FUZZ_REPORT=FILE` appends one JSON line per fuzz test
with the status codes its calls got (docs/security.md shows how to read it).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st

CALL_TIMEOUT = 10.0
#: Codes no request may ever produce: a crash, a bug, or a hang.
NEVER = {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNAVAILABLE,
}


def fuzz_settings(examples: int, limit: int | None = None) -> Callable[[Any], Any]:
    """Decorator (above @given) for one fuzz test: `examples` examples, or $KUBERL_FUZZ_EXAMPLES
    (at most `limit`, for requests with real side effects); no deadline (real services on a
    shared 2-core box); no example database (the services' state moves on). Derandomized
    unless $KUBERL_FUZZ_SEED gives a seed, so CI runs the same examples every time."""
    n = int(os.environ.get("KUBERL_FUZZ_EXAMPLES", "0") or 0) or examples
    n = min(n, limit) if limit else n
    seed_text = os.environ.get("KUBERL_FUZZ_SEED")
    configured = settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=not seed_text,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )

    def apply(test: Any) -> Any:
        test = configured(test)
        return seed(int(seed_text))(test) if seed_text else test

    return apply


# ---------------------------------------------------------------- scalars

INT32 = st.one_of(
    st.sampled_from([0, 1, -1, 2, 2**31 - 1, -(2**31), 4096, 4097]),
    st.integers(-(2**31), 2**31 - 1),
)
INT64 = st.one_of(
    st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63), 2**53 + 1, 10**12, 2**31]),
    st.integers(-(2**63), 2**63 - 1),
)
UINT32 = st.one_of(st.sampled_from([0, 1, 2**32 - 1]), st.integers(0, 2**32 - 1))
UINT64 = st.one_of(st.sampled_from([0, 1, 2**64 - 1]), st.integers(0, 2**64 - 1))
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e308, -1e308, 5e-324, -1.0, 1e-9]
DOUBLE = st.one_of(st.sampled_from(SPECIAL_FLOATS), st.floats(allow_nan=True))
FLOAT = st.one_of(st.sampled_from(SPECIAL_FLOATS[:8]), st.floats(width=32, allow_nan=True))
#: Waits of long-poll fields: hostile but short, so a fuzz run does not sit in a long poll.
SHORT_WAIT = st.sampled_from([math.nan, -math.inf, -1.0, -0.0, 0.0, 1e-9, 0.05])
ODD_STRINGS = [
    "",
    "train",
    "train:0",
    "eval:0",
    "sft-1",
    "train-0",
    "../../../../etc/passwd",
    "/etc/passwd",
    "/dev/zero",
    "/",
    ".",
    "os:system",
    "builtins:eval",
    "kuberl.common.plugins:load_plugin",
    "\x00",
    "\u202e\u0000\ufeff",
    "😀" * 5,
    "x" * 5000,
    "%s%n%x",
    "{}",
    "[1,2]",
    '{"a": NaN}',
    "null",
]
STRING = st.one_of(st.sampled_from(ODD_STRINGS), st.text(max_size=24))
BYTES = st.one_of(st.sampled_from([b"", b"\x00" * 7, b"\xff" * 64]), st.binary(max_size=48))

DTYPES = [
    "int32",
    "int64",
    "float32",
    "float16",
    "bfloat16",
    "uint8",
    "bool",
    "float64",
    "int8",
    "int128",
    "object",
    "O",
    "<U8",
    "V8",
    "complex64",
    "",
    "float32 ",
]


@st.composite
def tensors(draw: st.DrawFn) -> Any:
    """A Tensor whose dtype, shape and data may disagree (or, sometimes, agree)."""
    from kuberl.api.common.v1 import trajectory_pb2 as tpb

    dtype = draw(st.one_of(st.sampled_from(DTYPES), st.text(max_size=8)))
    shape = draw(
        st.one_of(
            st.just([]),
            st.lists(st.sampled_from([0, 1, 2, 3, -1, -(2**62), 2**31, 2**62]), max_size=3),
        )
    )
    data = draw(st.binary(max_size=40))
    return tpb.Tensor(dtype=dtype, shape=shape, data=data)


# ---------------------------------------------------------------- messages

_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_INT32: INT32,
    FieldDescriptor.TYPE_SINT32: INT32,
    FieldDescriptor.TYPE_SFIXED32: INT32,
    FieldDescriptor.TYPE_INT64: INT64,
    FieldDescriptor.TYPE_SINT64: INT64,
    FieldDescriptor.TYPE_SFIXED64: INT64,
    FieldDescriptor.TYPE_UINT32: UINT32,
    FieldDescriptor.TYPE_FIXED32: UINT32,
    FieldDescriptor.TYPE_UINT64: UINT64,
    FieldDescriptor.TYPE_FIXED64: UINT64,
    FieldDescriptor.TYPE_DOUBLE: DOUBLE,
    FieldDescriptor.TYPE_FLOAT: FLOAT,
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: STRING,
    FieldDescriptor.TYPE_BYTES: BYTES,
}


def message_class(descriptor: Descriptor) -> type:
    return message_factory.GetMessageClass(descriptor)  # type: ignore[no-any-return]


def _value(fd: FieldDescriptor, depth: int, overrides: dict[str, Any]) -> st.SearchStrategy[Any]:
    if fd.name in overrides:
        return overrides[fd.name]  # type: ignore[no-any-return]
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        if fd.message_type.full_name == "kuberl.common.v1.Tensor":
            return tensors()
        return messages(fd.message_type, depth + 1, overrides)
    if fd.type == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in fd.enum_type.values]
        return st.one_of(st.sampled_from(known), INT32)
    return _SCALARS[fd.type]


def messages(
    descriptor: Descriptor, depth: int = 0, overrides: dict[str, Any] | None = None
) -> st.SearchStrategy[Any]:
    """Any message of this type, hostile values in every field (nesting at most 3 deep).
    `overrides` maps a field name (at any depth) to the strategy to use for it."""
    overrides = overrides or {}
    cls = message_class(descriptor)
    if depth > 3:
        return st.just(cls())
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for fd in descriptor.fields:
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            key_fd, value_fd = (
                fd.message_type.fields_by_name["key"],
                fd.message_type.fields_by_name["value"],
            )
            parts[fd.name] = st.dictionaries(
                _value(key_fd, depth, overrides), _value(value_fd, depth, overrides), max_size=3
            )
        elif fd.is_repeated:
            parts[fd.name] = st.lists(_value(fd, depth, overrides), max_size=3)
        else:
            parts[fd.name] = _value(fd, depth, overrides)

    def build(values: dict[str, Any]) -> Any:
        msg = cls()
        for name, value in values.items():
            fd = descriptor.fields_by_name[name]
            target = getattr(msg, name) if fd.is_repeated else None
            if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                value_fd = fd.message_type.fields_by_name["value"]
                for k, v in value.items():
                    if value_fd.type == FieldDescriptor.TYPE_MESSAGE:
                        target[k].CopyFrom(v)  # type: ignore[index]
                    else:
                        target[k] = v  # type: ignore[index]
            elif target is not None:
                for v in value:
                    if fd.type == FieldDescriptor.TYPE_MESSAGE:
                        target.add().CopyFrom(v)
                    else:
                        target.append(v)
            elif fd.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return st.fixed_dictionaries({}, optional=parts).map(build)


# ---------------------------------------------------------------- calling


@dataclass(frozen=True)
class Method:
    service: str  # metric prefix: buffer, reward, rollout, trainer, weight_sync
    descriptor: MethodDescriptor

    @property
    def name(self) -> str:
        return str(self.descriptor.name)

    @property
    def path(self) -> str:
        return f"/{self.descriptor.containing_service.full_name}/{self.descriptor.name}"

    @property
    def request_class(self) -> type:
        return message_class(self.descriptor.input_type)

    def __str__(self) -> str:
        return f"{self.service}.{self.name}"


def methods(service: str, file_descriptor: Any) -> list[Method]:
    (svc,) = file_descriptor.services_by_name.values()
    return [Method(service, m) for m in svc.methods]


@dataclass
class RawCaller:
    """Calls one method with raw request bytes and records the status code of every call."""

    channel: grpc.Channel
    method: Method
    seen: Counter[grpc.StatusCode] = field(default_factory=Counter)

    def __call__(self, request: bytes | Any, timeout: float = CALL_TIMEOUT) -> grpc.StatusCode:
        data = request if isinstance(request, bytes) else request.SerializeToString()
        d = self.method.descriptor
        try:
            if d.client_streaming:
                self.channel.stream_unary(self.method.path)(iter([data]), timeout=timeout)
            elif d.server_streaming:
                for _ in self.channel.unary_stream(self.method.path)(data, timeout=timeout):
                    pass
            else:
                self.channel.unary_unary(self.method.path)(data, timeout=timeout)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
        self.seen[code] += 1
        return code


_ERRORS = re.compile(
    r'^kuberl_(\w+?)_rpc_errors_total\{code="(\w+)",method="(\w+)"\} ([0-9.e+]+)$', re.M
)


def rpc_errors(metrics_text: str, service: str) -> Counter[tuple[str, str]]:
    """`kuberl_<service>_rpc_errors_total` by (method, code name)."""
    out: Counter[tuple[str, str]] = Counter()
    for svc, code, method, value in _ERRORS.findall(metrics_text):
        if svc == service:
            out[(method, code)] = int(float(value))
    return out


def uncounted(
    before: Counter[tuple[str, str]],
    after: Counter[tuple[str, str]],
    method: str,
    seen: Counter[grpc.StatusCode],
) -> dict[str, tuple[int, int]]:
    """Codes the client saw more often than the service's error counter grew: {code: (seen,
    counted)}. Oversized messages are refused by gRPC before kuberl runs, so callers exclude
    RESOURCE_EXHAUSTED from a message-size test."""
    missing = {}
    for code, n in seen.items():
        if code is grpc.StatusCode.OK:
            continue
        counted = after[(method, code.name)] - before[(method, code.name)]
        if counted < n:
            missing[code.name] = (n, counted)
    return missing


def report(test: str, seen: Counter[grpc.StatusCode]) -> None:
    """Append the calls of one fuzz test to $KUBERL_FUZZ_REPORT (if set)."""
    path = os.environ.get("KUBERL_FUZZ_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "codes": {c.name: n for c, n in seen.items()}}))
            f.write("\n")
