"""How long queueing an epoch holds Redis: in slices (`buffer.queue_slice_prompts`) against the
whole epoch in one script (the baseline: a slice as large as the epoch), measured in the same run.

A buffer service (in-process, real embedded Redis) loads a dataset of `--prompts` prompts; then
one client leases 8 prompts at a time until `--leases` leases are done, the first of which queues
the epoch's first slice (baseline: all of it). Meanwhile a second client on its own thread and
connection sends PING in a loop: Redis runs one script at a time, so the longest PING is the
longest any other caller (another replica's lease, the trainer's GetBatch) waited for Redis.
Reported per arm: the longest PING, the first lease's latency, and the stream's length after the
leases (the epoch's prompts held in Redis). Goal: the longest stall ≤ 50 ms with 200,000 prompts
(the lease p99 goal of docs/scale.md).

    .venv/bin/python benchmarks/epoch_queue.py [--prompts 200000] [--leases 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.buffer.server import BufferService
from kuberl.common.config import parse_job_config
from kuberl.common.redis_server import EmbeddedRedis

GOAL_STALL_MS = 50.0
LEASE = 8


def write_prompts(path: Path, n: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"question": f"{i} + {i} = ?", "answer": 2 * i}) + "\n")
    return path


class PingProbe:
    """PINGs Redis from its own thread; `longest` is the longest answer in ms."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            while True:
                try:
                    self.client.ping()
                    break
                except redis.exceptions.BusyLoadingError:
                    time.sleep(0.001)
                except redis.exceptions.ResponseError as exc:
                    # A script past Redis's lua-time-limit (5 s): Redis answers BUSY until it
                    # ends, and the caller still waits for it.
                    if not str(exc).startswith("BUSY"):
                        raise
                    time.sleep(0.001)
            self.longest = max(self.longest, (time.perf_counter() - started) * 1000)
            time.sleep(0.001)

    def __enter__(self) -> PingProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()


async def arm(url: str, data: Path, queue_slice: int, leases: int) -> dict[str, Any]:
    config = parse_job_config(
        {
            "job": {"name": f"eq{uuid.uuid4().hex[:8]}", "seed": 1},
            "redis": {"url": url},
            "data": {"train": [{"path": str(data), "columns": {"prompt": "question"}}]},
            "rollout": {"group_size": 2},
            "buffer": {"queue_slice_prompts": queue_slice, "max_inflight_groups": 10**6},
        },
        env={},
    )
    svc = BufferService(config)
    await svc.start()
    try:
        first_ms = 0.0
        with PingProbe(url) as probe:
            for i in range(leases):
                started = time.perf_counter()
                req = bpb.LeasePromptsRequest(max_prompts=LEASE, consumer="r0")
                resp = await svc.LeasePrompts(req, None)  # type: ignore[arg-type]
                assert len(resp.prompts) == LEASE, "the dataset ran out: use fewer --leases"
                if i == 0:
                    first_ms = (time.perf_counter() - started) * 1000
        store = svc.db
        in_stream = int(await store.r.xlen(store.keys.prompts("train")))
    finally:
        await svc.stop()
    return {
        "queue_slice_prompts": queue_slice,
        "longest_redis_stall_ms": round(probe.longest, 1),
        "first_lease_ms": round(first_ms, 1),
        "prompts_in_stream": in_stream,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200_000)
    parser.add_argument("--leases", type=int, default=300)
    parser.add_argument("--slice", type=int, default=1024)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        data = write_prompts(Path(tmp) / "prompts.jsonl", args.prompts)
        with EmbeddedRedis(Path(tmp) / "redis", die_with_parent=True) as server:
            sliced = asyncio.run(arm(server.url, data, args.slice, args.leases))
            whole = asyncio.run(arm(server.url, data, args.prompts, args.leases))
    stall, base = sliced["longest_redis_stall_ms"], whole["longest_redis_stall_ms"]
    print(
        json.dumps(
            {
                "benchmark": "epoch_queue",
                "prompts": args.prompts,
                "sliced": sliced,
                "whole_epoch": whole,
                "ratio_stall_sliced_to_whole": round(stall / base, 4) if base else None,
                "goal": {"longest_stall_ms": GOAL_STALL_MS},
                "goal_met": stall <= GOAL_STALL_MS,
                "load_average": round(load, 1),
                "machine": f"{platform.node()}: {os.cpu_count()} CPU cores, load {load:.1f}",
            }
        )
    )


if __name__ == "__main__":
    main()
