"""Keepalive between our clients and servers: an idle client pings on schedule and the server
accepts those pings instead of closing the connection with GOAWAY `too_many_pings` (which it did
every ~90 s with gRPC's default server policy of one ping per 5 minutes). And our servers do not
share a port with another server (gRPC's default SO_REUSEPORT would)."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kuberl.common.server import grpc_options, server_grpc_options

KEEPALIVE_MS = 500  # the production 30 s scaled down, so that strikes accrue within the test


def _states_while_idle(server_options: list, seconds: float) -> list[grpc.ChannelConnectivity]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=server_options)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    seen: list[grpc.ChannelConnectivity] = []
    channel = grpc.insecure_channel(
        f"127.0.0.1:{port}", options=grpc_options(64 << 20, keepalive_ms=KEEPALIVE_MS)
    )
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        channel.subscribe(seen.append, try_to_connect=False)
        time.sleep(seconds)
        return seen
    finally:
        channel.close()
        server.stop(None)


def test_an_idle_client_keeps_its_connection_to_our_server() -> None:
    seen = _states_while_idle(server_grpc_options(64 << 20, keepalive_ms=KEEPALIVE_MS), 6.0)
    assert set(seen) == {grpc.ChannelConnectivity.READY}, seen


def test_without_the_server_allowance_the_connection_is_dropped() -> None:
    # The control: gRPC's default server policy answers the same pings with GOAWAY.
    seen = _states_while_idle(grpc_options(64 << 20, keepalive_ms=KEEPALIVE_MS), 6.0)
    assert seen[0] is grpc.ChannelConnectivity.READY
    assert grpc.ChannelConnectivity.IDLE in seen[1:], seen


def _second_bind(options: list) -> int:
    """The port a second server gets when it binds the port a first one listens on (0: none)."""
    first = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=options)
    port = first.add_insecure_port("127.0.0.1:0")
    first.start()
    second = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=options)
    try:
        try:
            return second.add_insecure_port(f"127.0.0.1:{port}")
        except RuntimeError:  # grpc raises on a failed bind in some versions, returns 0 in others
            return 0
    finally:
        second.stop(None)
        first.stop(None)


def test_our_servers_refuse_a_port_another_server_listens_on() -> None:
    # The control: gRPC's default (SO_REUSEPORT) lets the second one bind and share the port.
    assert _second_bind(grpc_options(64 << 20)) != 0
    assert _second_bind(server_grpc_options(64 << 20)) == 0


def test_a_reserved_port_refuses_others_until_our_server_binds_it() -> None:
    import socket

    from kuberl.common.metrics import start_metrics_server
    from kuberl.common.redis_server import PortReservation

    reserved = PortReservation()
    port, metrics_port = reserved.take(), reserved.take()
    try:
        with socket.socket() as other, socket.socket() as caller:
            try:
                other.bind(("127.0.0.1", port))
                taken = True
            except OSError:
                taken = False
            refused = caller.connect_ex(("127.0.0.1", port)) != 0
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=1), options=server_grpc_options(1 << 20)
        )
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                status = (
                    health_pb2_grpc.HealthStub(channel)
                    .Check(health_pb2.HealthCheckRequest(), timeout=5)
                    .status
                )
        finally:
            server.stop(None)
        metrics = start_metrics_server(metrics_port, "127.0.0.1")
    finally:
        reserved.release()
    assert (taken, refused, bound, status, metrics) == (
        False,
        True,
        port,
        health_pb2.HealthCheckResponse.SERVING,
        metrics_port,
    )
