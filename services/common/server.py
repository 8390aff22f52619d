"""The gRPC server bootstrap every kuberl service runs under (`kuberl serve <service>`).

A service subclasses `Service`: it registers its servicers, gets ready in `start()` (connect to
Redis, load a model...) and cleans up in `stop()`. `serve()` does the rest the same way for all:
grpc.aio with explicit message-size limits; health NOT_SERVING and the service's own methods
UNAVAILABLE until `start()` has returned (`StartGate`); reflection; one interceptor that turns
exceptions (and requests that do not parse) into status codes and counts calls; a Prometheus
/metrics endpoint; TLS from the job's `tls` section (`kuberl.common.tls`); and a graceful drain
on SIGTERM, which also interrupts a start still running. The contract: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError

from kuberl.common import metrics
from kuberl.common import tls as transport
from kuberl.common.config import ServerConfig, TLSConfig
from kuberl.common.errors import InvalidArgument, ServiceError, Unavailable
from kuberl.common.files import write_atomic
from kuberl.common.logs import get_logger
from kuberl.common.roles import RoleCheck, identity_source

log = get_logger(__name__)

RETRY_AFTER_KEY = "retry-after-seconds"
#: The retry hint of a call refused because the service is still starting.
STARTING_RETRY_SECONDS = 1.0
#: gRPC services answered while the service starts: health says NOT_SERVING, reflection only
#: describes the API (nothing `start()` prepares).
OPEN_WHILE_STARTING = ("grpc.health.v1.Health", reflection.SERVICE_NAME)
#: A start interrupted by SIGTERM gets this long to unwind, and then the threads it left working
#: this long to end before the process leaves without them (the local supervisor SIGKILLs a
#: service still starting 5 s after its SIGTERM).
STOP_STARTING_SECONDS = 2.0


class Service:
    """One deployable service as the bootstrap runs it. Subclasses override what they need."""

    #: Short name ("buffer", "weight_sync"): metric prefix and log field.
    name: str = "service"
    #: Fully-qualified gRPC service names, for health and reflection.
    service_names: Sequence[str] = ()
    #: What `start()` is busy with, for the UNAVAILABLE answer to calls that arrive meanwhile.
    starting: str = "its start() has not returned yet"

    def register(self, server: grpc.aio.Server) -> None:
        """Add this service's servicers to the server."""

    async def start(self) -> None:
        """Become ready to serve (connect dependencies). Until it returns, calls to this
        service's methods are answered UNAVAILABLE and health says NOT_SERVING. A SIGTERM
        cancels it, so a long wait must end on cancellation: awaited on the event loop, or in a
        thread only in short slices, never a thread blocked for minutes."""

    async def stop(self) -> None:
        """Release resources after in-flight calls have drained; also after a start that SIGTERM
        interrupted, so it releases only what was set up."""


KEEPALIVE_MS = 30_000


def grpc_options(max_message_bytes: int, keepalive_ms: int = KEEPALIVE_MS) -> list[tuple[str, Any]]:
    """Channel options shared by servers and clients: explicit size limits, keepalive pings
    every `keepalive_ms` (idle connections too), and a reconnect backoff capped at 5 s."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Notice a healed partition or a restarted peer within seconds: gRPC's default reconnect
        # backoff grows to 120 s (tests/reliability/test_network_partition.py).
        ("grpc.initial_reconnect_backoff_ms", 1000),
        ("grpc.max_reconnect_backoff_ms", 5000),
    ]


def server_grpc_options(
    max_message_bytes: int, keepalive_ms: int = KEEPALIVE_MS
) -> list[tuple[str, Any]]:
    """`grpc_options` plus what a server must allow for its clients' keepalive: by default a
    server tolerates one ping per 5 minutes on an idle connection and answers more frequent ones
    with GOAWAY `too_many_pings`, which would drop our idle clients' connections.

    SO_REUSEPORT off: with gRPC's default a second server could bind a port another already
    listens on and the kernel would split the connections between them (two local runs serving
    each other's clients); now the second bind fails and says so."""
    return [
        *grpc_options(max_message_bytes, keepalive_ms),
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive_ms // 2),
        ("grpc.so_reuseport", 0),
    ]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a caller sees for an exception raised by a handler."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, ValidationError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, RecursionError):
        # json.loads and friends on hostile input (a JSON text thousands of levels deep).
        return grpc.StatusCode.INVALID_ARGUMENT, "input nested too deeply to be parsed"
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc) or "not implemented"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


class Undecodable:
    """What a handler receives instead of a request whose bytes do not parse as its message, so
    the caller gets a counted INVALID_ARGUMENT rather than gRPC's uncounted UNKNOWN."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def rejection(self) -> InvalidArgument:
        return InvalidArgument(
            f"the request is not a valid message of this method: {type(self.error).__name__}: "
            f"{self.error}"
        )


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """A deserializer that hands `Undecodable` to the handler instead of raising in gRPC."""
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:
            return Undecodable(exc)

    return parse


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Undecodable):
            raise request.rejection()
        yield request


def _checked(request: Any) -> Any:
    """The request for the servicer: a parsed message, or a stream that raises on bad items."""
    if isinstance(request, Undecodable):
        raise request.rejection()
    if hasattr(request, "__aiter__"):
        return _checked_stream(request)
    return request


class StartGate:
    """Closed until the service's `start()` has returned: its methods answer UNAVAILABLE.

    One check for every service instead of one in each handler that needs it, so no handler
    can run on state `start()` has not set up."""

    def __init__(self, service: Service) -> None:
        self.name = service.name
        self.starting = service.starting
        self.ready = False

    def open(self) -> None:
        self.ready = True

    @staticmethod
    def guards(method: str) -> bool:
        """Whether calls of `method` ("/package.Service/Method") wait for the start."""
        return method.lstrip("/").rsplit("/", 1)[0] not in OPEN_WHILE_STARTING

    def check(self) -> None:
        if not self.ready:
            raise Unavailable(
                f"{self.name} is starting ({self.starting}); retry once its health check "
                "says SERVING",
                retry_after_seconds=STARTING_RETRY_SECONDS,
            )


#: A check run before a handler, with its context (raises a ServiceError to refuse the call).
Guard = Callable[[grpc.aio.ServicerContext], None]


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions to status codes and records per-method request counts and latency;
    with a `gate`, refuses the service's own methods (UNAVAILABLE) until it is open."""

    def __init__(
        self, service: str, gate: StartGate | None = None, roles: RoleCheck | None = None
    ) -> None:
        self.gate = gate
        self.roles = roles
        self.requests = metrics.counter(
            f"kuberl_{service}_rpc_requests_total", "gRPC calls handled", ["method", "code"]
        )
        self.errors = metrics.counter(
            f"kuberl_{service}_rpc_errors_total", "gRPC calls that failed", ["method", "code"]
        )
        self.latency = metrics.histogram(
            f"kuberl_{service}_rpc_seconds",
            "gRPC call latency",
            ["method"],
            buckets=metrics.RPC_SECONDS_BUCKETS,
        )

    def _record(self, method: str, code: grpc.StatusCode, started: float) -> None:
        self.requests.labels(method, code.name).inc()
        if code is not grpc.StatusCode.OK:
            self.errors.labels(method, code.name).inc()
        self.latency.labels(method).observe(time.perf_counter() - started)

    async def _fail(
        self, method: str, exc: Exception, context: grpc.aio.ServicerContext, started: float
    ) -> None:
        code, message = status_for(exc)
        if code is grpc.StatusCode.INTERNAL:
            log.exception("rpc.internal_error", method=method)
        elif isinstance(exc, RecursionError):  # louder: it could also be a bug of ours
            log.warning("rpc.rejected", method=method, code=code.name, reason=message)
        else:
            log.info("rpc.rejected", method=method, code=code.name, reason=message)
        retry = getattr(exc, "retry_after_seconds", None)
        if retry is not None:
            context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{retry:.3f}"),))
        self._record(method, code, started)
        await context.abort(code, message)

    def _wrap_unary(
        self, method: str, behavior: Callable[..., Any], guard: Guard | None
    ) -> Callable[..., Awaitable[Any]]:
        async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            try:
                if guard is not None:
                    guard(context)
                result = behavior(_checked(request), context)
                if inspect.isawaitable(result):
                    result = await result
            except grpc.aio.AbortError:
                self._record(method, context.code() or grpc.StatusCode.UNKNOWN, started)
                raise
            except Exception as exc:
                await self._fail(method, exc, context, started)
                return None
            self._record(method, grpc.StatusCode.OK, started)
            return result

        return handler

    def _wrap_stream(
        self, method: str, behavior: Callable[..., Any], guard: Guard | None
    ) -> Callable[..., AsyncIterator[Any]]:
        async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started = time.perf_counter()
            try:
                if guard is not None:
                    guard(context)
                async for item in behavior(_checked(request), context):
                    yield item
            except grpc.aio.AbortError:
                self._record(method, context.code() or grpc.StatusCode.UNKNOWN, started)
                raise
            except Exception as exc:
                await self._fail(method, exc, context, started)
                return
            self._record(method, grpc.StatusCode.OK, started)

        return handler

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        path = handler_call_details.method
        method = path.rsplit("/", 1)[-1]
        guard = self._guard(
            path, self.gate if self.gate is not None and StartGate.guards(path) else None
        )
        kw = {
            "request_deserializer": _tolerant(handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(method, handler.unary_unary, guard), **kw
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(method, handler.stream_unary, guard), **kw
            )
        # Streaming handlers are either async generators or coroutines that call context.write
        # (grpc's own health Watch does); each keeps its style when wrapped.
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_any(method, handler.unary_stream, guard), **kw
            )
        return grpc.stream_stream_rpc_method_handler(
            self._wrap_any(method, handler.stream_stream, guard), **kw
        )

    def _guard(self, path: str, gate: StartGate | None) -> Guard | None:
        """What runs before the handler: the caller's role (first: a caller that may not call
        the method learns nothing else), then the start gate."""
        roles = self.roles if self.roles is not None and self.roles.restricted(path) else None
        if roles is None and gate is None:
            return None

        def guard(context: grpc.aio.ServicerContext) -> None:
            if roles is not None:
                roles.check(path, context)
            if gate is not None:
                gate.check()

        return guard

    def _wrap_any(
        self, method: str, behavior: Callable[..., Any], guard: Guard | None
    ) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            return self._wrap_stream(method, behavior, guard)
        return self._wrap_unary(method, behavior, guard)


async def _interrupt_start(starting: asyncio.Task[None]) -> None:
    """Cancel a start that SIGTERM interrupted and give it a moment to unwind."""
    log.info("server.start_interrupted")
    starting.cancel()
    await asyncio.wait({starting}, timeout=STOP_STARTING_SECONDS)
    if not starting.done():  # it swallowed the cancellation: stop() runs beside it
        log.warning("server.start_not_interrupted", waited_seconds=STOP_STARTING_SECONDS)
    elif not starting.cancelled() and starting.exception() is not None:
        log.warning("server.start_failed_while_stopping", error=repr(starting.exception()))


async def _leave_start_behind(executor: ThreadPoolExecutor) -> None:
    """End the process now if threads of an interrupted start are still working.

    asyncio.run and the interpreter both wait for every thread of the loop's executor to end,
    and a thread cannot be interrupted: one loading a model (or waiting in a torchrun
    rendezvous) would keep the stopped process alive until Kubernetes SIGKILLs it."""
    ended = threading.Event()

    def shut_down() -> None:
        executor.shutdown(wait=True)
        ended.set()

    threading.Thread(target=shut_down, name="start-threads", daemon=True).start()
    deadline = time.monotonic() + STOP_STARTING_SECONDS
    while not ended.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not ended.is_set():
        log.warning("server.start_left_behind", reason="its threads are still working")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _write_port_file(path: str, ports: dict[str, int]) -> None:
    write_atomic(path, json.dumps(ports))


async def serve(
    service: Service,
    config: ServerConfig,
    *,
    port_file: str | None = None,
    stop_event: asyncio.Event | None = None,
    tls: TLSConfig | None = None,
    job: str = "",
) -> None:
    """Run `service` until SIGTERM/SIGINT (or `stop_event`), then drain and stop it. It owns
    the process (`kuberl serve`): it installs the signal handlers and, after a start it had to
    interrupt, may end the process itself.

    `tls` is the job's `tls` section (None: `kuberl.common.tls.current()`); it secures this
    server and becomes the process default for the service's own client channels. With
    `tls.roles` (certificates) or in a `kuberl run` (its tokens), callers of restricted methods
    must carry a role of `job` (kuberl.common.roles)."""
    tls = tls if tls is not None else transport.current()
    transport.configure(tls)
    credentials = transport.server_credentials(tls) if tls.enabled else None
    gate = StartGate(service)
    source = identity_source(tls)
    roles = RoleCheck(service.name, job, source) if source is not None else None
    server = grpc.aio.server(
        options=server_grpc_options(config.max_message_bytes),
        interceptors=[ErrorInterceptor(service.name, gate, roles)],
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service.service_names)
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    service.register(server)
    reflection.enable_server_reflection(
        (
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    address = f"{config.host}:{config.port}"
    if credentials is not None:
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"{service.name}: cannot bind {config.host}:{config.port}")
    metrics_port = metrics.start_metrics_server(config.metrics_port, config.host)
    await server.start()
    log.info(
        "server.listening",
        port=port,
        metrics_port=metrics_port,
        tls="mutual" if tls.require_client_cert else "on" if tls.enabled else "off",
    )
    if port_file:
        _write_port_file(port_file, {"port": port, "metrics_port": metrics_port})

    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    # The loop's own executor, so that what an interrupted start left in its threads can be
    # waited for with a bound (`_leave_start_behind`).
    executor = ThreadPoolExecutor(thread_name_prefix="asyncio")
    loop.set_default_executor(executor)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    ready_task = asyncio.create_task(service.start())
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({ready_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    started = ready_task in done
    if started:
        ready_task.result()  # a failed start ends the process with its error
        gate.open()  # before SERVING: a client that saw SERVING is never refused as starting
        for name in ("", *names):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("server.ready")
        await stop_task
    else:
        await _interrupt_start(ready_task)

    # Until the start returned only health and reflection ran: nothing to drain.
    grace = config.grace_seconds if started else 0.0
    log.info("server.draining", grace_seconds=grace)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace)
    await service.stop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Stopped: a repeated signal (the local supervisor sends a second SIGTERM to a process
        # still exiting) must not kill it with -15 once the loop's handlers are gone.
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
    log.info("server.stopped")
    if not started:
        await _leave_start_behind(executor)
