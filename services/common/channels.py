"""Client side of the gRPC runtime: channels with the same limits as servers, and readiness waits.

Every service that calls another (rollout -> buffer, trainer -> weight-sync, the supervisor ->
everyone) opens its channels here, so message-size limits, keepalive and transport security
agree on both ends. A channel is TLS (and presents a client certificate under mutual TLS) when
the `tls` settings say so: the ones passed, else the process default of `kuberl.common.tls`
(the job's `tls` section inside a service, `KUBERL_TLS__*` variables elsewhere). In a `kuberl
run`, every call also carries this process's role token (`kuberl.common.roles`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kuberl.common import tls as transport
from kuberl.common.config import TLSConfig
from kuberl.common.roles import TOKEN_METADATA, own_token
from kuberl.common.server import grpc_options

#: How often a service's start asks a dependency whether it is SERVING yet.
DEPENDENCY_POLL_SECONDS = 0.05

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def _with_token(details: Any, token: str) -> Any:
    """The call's details with the role token added to its metadata."""
    metadata = [*(details.metadata or ()), (TOKEN_METADATA, token)]
    return details._replace(metadata=metadata)


class _SyncToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Presents the process's role token on every call of a blocking channel."""

    def __init__(self, token: str) -> None:
        self.token = token

    def _call(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(_with_token(details, self.token), request)

    intercept_unary_unary = intercept_unary_stream = _call
    intercept_stream_unary = intercept_stream_stream = _call


class _AioToken(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    """Presents the process's role token on every call of an asyncio channel."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def _call(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.token), request)

    intercept_unary_unary = intercept_unary_stream = _call
    intercept_stream_unary = intercept_stream_stream = _call


def aio_channel(
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    *,
    tls: TLSConfig | None = None,
    token: str | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel to address (TLS per `tls`, default: the process's settings), its
    calls carrying `token` (default: the process's own; '' for none)."""
    tls = tls if tls is not None else transport.current()
    token = own_token() if token is None else token
    options = grpc_options(max_message_bytes) + transport.channel_options(tls)
    interceptors = [_AioToken(token)] if token else None
    if tls.enabled:
        credentials = transport.channel_credentials(tls)
        return grpc.aio.secure_channel(address, credentials, options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def sync_channel(
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    *,
    tls: TLSConfig | None = None,
    token: str | None = None,
) -> grpc.Channel:
    """A blocking channel to address (TLS per `tls`, default: the process's settings), its
    calls carrying `token` (default: the process's own; '' for none)."""
    tls = tls if tls is not None else transport.current()
    token = own_token() if token is None else token
    options = grpc_options(max_message_bytes) + transport.channel_options(tls)
    if tls.enabled:
        channel = grpc.secure_channel(address, transport.channel_credentials(tls), options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(channel, _SyncToken(token)) if token else channel


def health_status(channel: grpc.Channel, service: str = "", timeout: float = 2.0) -> str:
    """SERVING / NOT_SERVING / UNKNOWN / SERVICE_UNKNOWN, or UNAVAILABLE when unreachable."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as exc:
        return "UNAVAILABLE" if exc.code() is not grpc.StatusCode.NOT_FOUND else "SERVICE_UNKNOWN"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def wait_serving(
    address: str, timeout: float = 60.0, service: str = "", *, tls: TLSConfig | None = None
) -> None:
    """Block until the server at address reports SERVING; TimeoutError says what it last saw."""
    deadline = time.monotonic() + timeout
    last = "UNAVAILABLE"
    with sync_channel(address, tls=tls) as channel:
        while time.monotonic() < deadline:
            last = health_status(channel, service)
            if last == "SERVING":
                return
            time.sleep(0.05)
    raise TimeoutError(f"{address} not SERVING after {timeout:.0f}s (last status {last})")


async def wait_for_dependency(name: str, address: str, timeout: float) -> None:
    """Wait in a service's `start()` until `name`'s server at `address` reports SERVING;
    TimeoutError says what it last answered. It asks on the event loop, so the SIGTERM that
    cancels the start ends it at once; a wait in a thread would hold a stopping process for up
    to its whole `timeout`."""
    deadline = time.monotonic() + timeout
    last = "UNAVAILABLE"
    async with aio_channel(address) as channel:
        health_stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                answer = await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
            except grpc.aio.AioRpcError as exc:
                last = exc.code().name
            if last == "SERVING":
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{name} at {address} not SERVING after {timeout:.0f}s (last status {last})"
                )
            await asyncio.sleep(DEPENDENCY_POLL_SECONDS)
