"""A pool of worker processes for CPU-bound verifiers, with hard per-sample timeouts.

`concurrent.futures.ProcessPoolExecutor` cannot stop one task: a verifier that never returns
holds its worker forever and the pool leaks capacity. Here each worker (`kuberl.reward.worker`) is
a subprocess in its own session driven by one asyncio task that feeds it from a shared queue.

Each exchange carries a chunk of up to `chunk_size` queued samples (one pipe write each way for
a fast chunk instead of one per sample: on a busy machine the context switches of a round trip
cost more than a GSM8K check). The worker streams results back whenever 50 ms have passed since
its last write, so the pool sees progress. The per-sample timeout is measured from the last sign
of progress (the chunk's dispatch or the last result received), never while samples queue.

When it passes, the worker's whole process group is SIGKILLed and a fresh worker takes the
slot. Samples of the chunk without a result are put back at the head of the queue to run alone,
so results lost with the worker are recomputed and the sample that really hangs is found: run
alone, it fails with reason `timeout` naming the verifier that was running (at the cost of a
second timeout). A worker that dies (a verifier calling `os._exit`, a segfault in a C
extension) is handled the same way, ending in `worker_died`. Requests and answers are JSON lines,
never pickles.
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
CHUNK_SIZE = 32
# Queue priorities within one rank: samples re-run alone after a failed chunk go first.
SOLO, NEW = 0, 1

_restarts = metrics.counter(
    "kuberl_reward_worker_restarts_total",
    "Reward worker processes replaced, by reason (timeout, died)",
    ["reason"],
)


@dataclass(eq=False)
class _Request:
    id: int
    verifiers: list[str]
    sample: dict[str, Any]
    future: asyncio.Future[dict[str, Any]]
    running: str = ""
    solo: bool = False
    rank: int = 0  # its place in its caller's batch (see WorkerPool.run)


@dataclass
class _Worker:
    proc: asyncio.subprocess.Process
    pid: int = field(init=False)

    def __post_init__(self) -> None:
        self.pid = self.proc.pid


class WorkerPool:
    """`size` worker processes scoring requests with a per-request `timeout`."""

    def __init__(
        self, size: int, config_json: str, timeout: float, chunk_size: int = CHUNK_SIZE
    ) -> None:
        self.size = size
        self.timeout = timeout
        self.chunk_size = chunk_size
        self._config_line = config_json.encode() + b"\n"
        self._queue: asyncio.PriorityQueue[tuple[int, int, int, _Request]] = asyncio.PriorityQueue()
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

    async def run(
        self, verifiers: list[str], sample: dict[str, Any], rank: int = 0
    ) -> dict[str, Any]:
        """Results by verifier name: `{"score": ...}` or `{"error": reason, "message": ...}`.

        `rank` is the sample's place in its caller's batch: the queue serves rank 0 of every
        waiting batch, then rank 1, ..., so concurrent callers share the workers round-robin and
        a batch of slow or hanging samples cannot hold another caller's scores behind it."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        request = _Request(next(self._ids), verifiers, sample, future, rank=rank)
        self._queue.put_nowait((rank, NEW, request.id, request))
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

    async def _next_chunk(self) -> list[_Request]:
        """Up to chunk_size queued requests whose callers still wait; a solo one goes alone."""
        chunk: list[_Request] = []
        while not chunk:
            *_, first = await self._queue.get()
            if first.future.done():  # its caller went away while it queued
                continue
            chunk.append(first)
            # Share what is queued among the workers rather than give it all to the first.
            size = min(self.chunk_size, -(-(self._queue.qsize() + 1) // self.size))
            while not first.solo and len(chunk) < size and not self._queue.empty():
                entry = self._queue.get_nowait()
                request = entry[-1]
                if request.solo:
                    self._queue.put_nowait(entry)
                    break
                if not request.future.done():
                    chunk.append(request)
        return chunk

    async def _serve(self, slot: int) -> None:
        while True:
            chunk = await self._next_chunk()
            worker = self._workers[slot]
            assert worker is not None
            failure = await self._exchange(worker, chunk)
            if failure is None:
                continue
            reason, message = failure
            unanswered = [r for r in chunk if not r.future.done()]
            if len(chunk) == 1 and unanswered:
                request = unanswered[0]
                running = request.running or request.verifiers[0]
                results = {
                    name: {"error": "skipped", "message": f"not scored: {running} failed"}
                    for name in request.verifiers
                }
                results[running] = {"error": reason, "message": message}
                request.future.set_result(results)
            else:
                for request in unanswered:
                    request.solo, request.running = True, ""
                    self._queue.put_nowait((request.rank, SOLO, request.id, request))
            await self._replace(slot, "timeout" if reason == "timeout" else "died")

    async def _exchange(self, worker: _Worker, chunk: list[_Request]) -> tuple[str, str] | None:
        """Send a chunk and hand out its results; or say why the worker must be replaced."""
        proc = worker.proc
        assert proc.stdin is not None and proc.stdout is not None
        items = [{"i": r.id, "verifiers": r.verifiers, "sample": r.sample} for r in chunk]
        pending = {r.id: r for r in chunk}
        try:
            proc.stdin.write(json.dumps({"items": items}).encode() + b"\n")
            await proc.stdin.drain()
            while pending:
                # Each line is progress: the timeout restarts from the last one received.
                raw = await asyncio.wait_for(proc.stdout.readline(), self.timeout)
                if not raw:
                    return "worker_died", f"worker process {worker.pid} died"
                answer = json.loads(raw)
                request = pending[answer["i"]]
                if "running" in answer:
                    request.running = answer["running"]
                    continue
                del pending[answer["i"]]
                if not request.future.done():
                    request.future.set_result(dict(answer["results"]))
        except TimeoutError:
            return "timeout", f"no result after {self.timeout:g}s (worker killed)"
        except (ConnectionError, BrokenPipeError):
            return "worker_died", f"worker process {worker.pid} died"
        except (ValueError, KeyError) as exc:  # a line that is not the protocol
            return "worker_died", f"worker process {worker.pid} sent a bad answer: {exc}"
        except Exception as exc:  # e.g. a sample json.dumps cannot write: never end this slot
            log.exception("pool.exchange_failed", pid=worker.pid, samples=len(chunk))
            return "error", f"could not score: {type(exc).__name__}: {exc}"
        return None
