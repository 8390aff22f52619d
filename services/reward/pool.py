"""A pool of worker processes for CPU-bound verifiers, with hard per-sample timeouts.

`concurrent.futures.ProcessPoolExecutor` cannot stop one task: a verifier that never returns
holds its worker forever and the pool leaks capacity. Here each worker (`kuberl.reward.worker`) is
a subprocess in its own session driven by one asyncio task that feeds it one request at a time
from a shared queue. The timeout starts when a request reaches a worker (not while it queues).
When it passes, the worker's whole process group is SIGKILLed, the request fails with reason
`timeout` naming the verifier that was running, and a fresh worker takes the slot; a worker that
dies (a verifier calling `os._exit`, a segfault in a C extension) fails its request with
`worker_died` and is replaced the same way. Requests and answers are JSON lines, never pickles.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

from kuberl.common import metrics
from kuberl.common.logs import get_logger

log = get_logger(__name__)

READY_TIMEOUT_SECONDS = 120.0
STREAM_LIMIT = 64 * 1024 * 1024

_restarts = metrics.counter(
    "kuberl_reward_worker_restarts_total",
    "Reward worker processes replaced, by reason (timeout, died)",
    ["reason"],
)


@dataclass
class _Request:
    id: int
    verifiers: list[str]
    sample: dict[str, Any]
    future: asyncio.Future[dict[str, Any]]
    running: str = ""


@dataclass
class _Worker:
    proc: asyncio.subprocess.Process
    pid: int = field(init=False)

    def __post_init__(self) -> None:
        self.pid = self.proc.pid


class WorkerPool:
    """`size` worker processes scoring requests with a per-request `timeout`."""

    def __init__(self, size: int, config_json: str, timeout: float) -> None:
        self.size = size
        self.timeout = timeout
        self._config_line = config_json.encode() + b"\n"
        self._queue: asyncio.Queue[_Request] = asyncio.Queue()
        self._ids = itertools.count()
        self._workers: list[_Worker | None] = [None] * size
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def pids(self) -> list[int]:
        """Pids of the live workers (for tests and diagnostics)."""
        return [w.pid for w in self._workers if w is not None]

    async def start(self) -> None:
        """Start every worker and wait until all are ready."""
        for slot, worker in enumerate(
            await asyncio.gather(*[self._spawn() for _ in range(self.size)])
        ):
            self._workers[slot] = worker
        self._tasks = [asyncio.create_task(self._serve(slot)) for slot in range(self.size)]
        log.info("pool.started", workers=self.size, pids=self.pids)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                await self._kill(worker)
                self._workers[slot] = None

    async def run(self, verifiers: list[str], sample: dict[str, Any]) -> dict[str, Any]:
        """Results by verifier name: `{"score": ...}` or `{"error": reason, "message": ...}`."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Request(next(self._ids), verifiers, sample, future))
        return await future

    async def _spawn(self) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kuberl.reward.worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
            limit=STREAM_LIMIT,
        )
        worker = _Worker(proc)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(self._config_line)
            await proc.stdin.drain()
            line = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_SECONDS)
        except BaseException:
            await self._kill(worker)
            raise
        if not line.startswith(b'{"ready"'):
            await self._kill(worker)
            raise RuntimeError(f"reward worker {worker.pid} exited during start (see its log)")
        return worker

    async def _kill(self, worker: _Worker) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        await worker.proc.wait()

    async def _replace(self, slot: int, reason: str) -> None:
        old = self._workers[slot]
        self._workers[slot] = None
        if old is not None:
            await self._kill(old)
        _restarts.labels(reason).inc()
        delay = 0.1
        while self._workers[slot] is None:
            try:
                self._workers[slot] = await self._spawn()
            except Exception:
                log.exception("pool.spawn_failed", slot=slot, retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
        log.info("pool.worker_replaced", slot=slot, reason=reason, old=old and old.pid)

    async def _serve(self, slot: int) -> None:
        while True:
            request = await self._queue.get()
            if request.future.done():  # its caller went away while it queued
                continue
            worker = self._workers[slot]
            assert worker is not None
            outcome = await self._exchange(worker, request)
            if isinstance(outcome, dict):
                if not request.future.done():
                    request.future.set_result(outcome)
                continue
            reason, message = outcome
            running = request.running or request.verifiers[0]
            results = {
                name: {"error": "skipped", "message": f"not scored: {running} failed"}
                for name in request.verifiers
            }
            results[running] = {"error": reason, "message": message}
            if not request.future.done():
                request.future.set_result(results)
            await self._replace(slot, "timeout" if reason == "timeout" else "died")

    async def _exchange(
        self, worker: _Worker, request: _Request
    ) -> dict[str, Any] | tuple[str, str]:
        """Send one request and read its results, or say why the worker must be replaced."""
        proc = worker.proc
        assert proc.stdin is not None and proc.stdout is not None
        line = {"id": request.id, "verifiers": request.verifiers, "sample": request.sample}
        try:
            proc.stdin.write(json.dumps(line).encode() + b"\n")
            await proc.stdin.drain()
            async with asyncio.timeout(self.timeout):
                while True:
                    raw = await proc.stdout.readline()
                    if not raw:
                        return "worker_died", f"worker process {worker.pid} died"
                    answer = json.loads(raw)
                    if "running" in answer:
                        request.running = answer["running"]
                        continue
                    return dict(answer["results"])
        except TimeoutError:
            return "timeout", f"no result after {self.timeout:g}s (worker killed)"
        except (ConnectionError, BrokenPipeError):
            return "worker_died", f"worker process {worker.pid} died"
        except (ValueError, KeyError) as exc:  # a line that is not the protocol
            return "worker_died", f"worker process {worker.pid} sent a bad answer: {exc}"
