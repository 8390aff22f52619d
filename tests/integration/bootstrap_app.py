"""A small service run under kuberl's real server bootstrap, for tests of the bootstrap itself.

It implements the reward proto's `Score` with behaviours chosen by `sample_id` (sleep, raise an
expected error, raise a bug, signal backpressure) so the tests can watch health, reflection,
size limits, error mapping and the SIGTERM drain of a real server in its own process. It is not
the reward service; it only borrows its contract to have a real, reflectable proto.

    python tests/integration/bootstrap_app.py --port-file F [--ready-delay S] [--grace S]
        [--delay-in-thread] [--stopped-file F]

`--delay-in-thread` spends the start's delay in a thread, as a model load does (nothing can
interrupt it); `--stopped-file` is touched by the service's `stop()`.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import grpc

from kuberl.api.reward.v1 import reward_pb2, reward_pb2_grpc
from kuberl.common.config import ServerConfig
from kuberl.common.errors import InvalidArgument, ResourceExhausted
from kuberl.common.logs import setup_logging
from kuberl.common.server import Service, serve


class _Scorer(reward_pb2_grpc.RewardServiceServicer):
    async def Score(
        self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        scores = []
        for sample in request.samples:
            kind, _, arg = sample.sample_id.partition(":")
            if kind == "sleep":  # sleep:SECONDS or sleep:SECONDS:FILE (touched first)
                seconds, _, marker = arg.partition(":")
                if marker:
                    Path(marker).touch()
                await asyncio.sleep(float(seconds))
            elif kind == "invalid":
                raise InvalidArgument(f"sample {sample.sample_id}: response is empty")
            elif kind == "bug":
                raise RuntimeError("boom")
            elif kind == "busy":
                raise ResourceExhausted("too many samples in flight", retry_after_seconds=1.5)
            scores.append(reward_pb2.SampleScore(sample_id=sample.sample_id, reward=1.0))
        return reward_pb2.ScoreResponse(scores=scores)


class BootstrapTestService(Service):
    name = "bootstraptest"
    service_names = (reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name,)

    def __init__(self, ready_delay: float, in_thread: bool, stopped_file: str | None) -> None:
        self.ready_delay = ready_delay
        self.in_thread = in_thread
        self.stopped_file = stopped_file

    def register(self, server: grpc.aio.Server) -> None:
        reward_pb2_grpc.add_RewardServiceServicer_to_server(_Scorer(), server)

    async def start(self) -> None:
        if self.in_thread:
            await asyncio.to_thread(time.sleep, self.ready_delay)
        else:
            await asyncio.sleep(self.ready_delay)

    async def stop(self) -> None:
        if self.stopped_file:
            Path(self.stopped_file).touch()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--max-message-bytes", type=int, default=1024 * 1024)
    parser.add_argument("--ready-delay", type=float, default=0.0)
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("--delay-in-thread", action="store_true")
    parser.add_argument("--stopped-file")
    args = parser.parse_args()
    setup_logging("bootstraptest")
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        max_message_bytes=args.max_message_bytes,
        grace_seconds=args.grace,
    )
    service = BootstrapTestService(args.ready_delay, args.delay_in_thread, args.stopped_file)
    asyncio.run(serve(service, config, port_file=args.port_file))


if __name__ == "__main__":
    main()
