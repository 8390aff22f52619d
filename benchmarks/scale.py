"""Scale: how each shared component's cost grows with the number of rollout replicas (one box).

Every piece is the real one except the model: an embedded Redis, `kuberl serve buffer`,
`kuberl serve reward` (the `length` verifier) and `kuberl serve weight_sync` as subprocesses, and
N rollout replicas, each a real `RolloutService` (its own RolloutWorker, buffer and reward gRPC
channels and weight-sync `EngineClient`) around a `simulated` engine (tokens at a set rate, no
model), grouped into a few host processes to fit the machine. A trainer stand-in in this process
consumes the trajectory stream as the trainer does (GetBatch acknowledging the previous batch) and
publishes weights with the real `WeightPublisher` (snapshot upload: engines on other hosts).

Per N (default 4, 16, 64, 256), over a steady window: LeasePrompts / PutTrajectories latency
p50/p99 seen by the replicas, trajectories/s through the buffer, buffer and Redis CPU per 1,000
trajectories (/proc/<pid>/stat), Redis memory per in-flight group, weight-sync CPU per engine
per second (heartbeats and registry), errors other than backpressure; then the time from a
version's publish to every engine holding it, with the bytes weight-sync itself sent and the
bytes engines relayed to each other. At the largest N, the buffer's throughput when it is the
bound (engines 50x faster) with one buffer replica and with two against the same Redis.
Ratios are against the smallest N of the same run. Last line: one JSON object.

    .venv/bin/python benchmarks/scale.py [--replicas 4 16 64 256] [--hosts 4] [--seconds 20]
        [--payload-mb 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from buffer_throughput import _proc_cpu_seconds, machine  # noqa: E402

from tests.support import ServiceProcess  # noqa: E402

GROUP_SIZE = 4
BUFFER_CALLS = ("LeasePrompts", "PutTrajectories")
PROMPTS_PER_BATCH = 2
BATCH_GROUPS = 32
#: Goals of issue 29 (checked here, never by a timed test).
GOAL_P99_MS = 50.0
GOAL_CPU_RATIO = 1.5
GOAL_FANOUT_RATIO = 3.0
GOAL_TWO_BUFFERS = 1.7


# ---------------------------------------------------------------- the job


@dataclass
class Workload:
    tokens_per_second: float = 40.0
    response_tokens: int = 128
    length_sigma: float = 0.3
    max_new_tokens: int = 512
    relay_fanout: int = 2


def job(
    workdir: Path, name: str, redis_url: str, prompts: Path, model: Path, work: Workload
) -> dict[str, Any]:
    """The job file's contents, services on port 0 (each writes its port file)."""
    server = {"host": "127.0.0.1", "port": 0, "metrics_port": 0}
    return {
        "job": {"name": name},
        "redis": {"url": redis_url},
        "model": {"path": str(model)},
        "data": {"train": [{"path": str(prompts)}]},
        "rollout": {
            "server": {**server},
            "group_size": GROUP_SIZE,
            "prompts_per_batch": PROMPTS_PER_BATCH,
            "batches_in_flight": 1,
            "engine": {
                "kind": "simulated",
                "tokens_per_second": work.tokens_per_second,
                "response_tokens": work.response_tokens,
                "length_sigma": work.length_sigma,
                "vocab_size": 12,  # token ids the tiny character tokenizer decodes
            },
            "sampling": {"max_new_tokens": work.max_new_tokens},
            "catch_up_seconds": 600,
            # A version loads at once (running samples are regenerated on it): the fan-out
            # time is weight-sync's, not the length of the generations it would wait for.
            "on_weight_update": "abort",
        },
        "reward": {"server": {**server}, "verifiers": {"length": 1.0}, "workers": 1},
        "buffer": {
            "server": {**server},
            "max_inflight_groups": 4096,
            "lease_timeout_seconds": 600,
            "batch_ack_timeout_seconds": 600,
        },
        "weight_sync": {
            "server": {**server},
            # Engines on other hosts than the service: every version travels as a snapshot.
            "transports": ["snapshot"],
            "snapshot_dir": str(workdir / "snapshots"),
            "shm_dir": str(workdir / "no-shm" / "x"),
            "broadcast_timeout_seconds": 120,
            "relay_fanout": work.relay_fanout,
        },
    }


def write_job(path: Path, data: dict[str, Any]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(data))
    return path


# ---------------------------------------------------------------- replica hosts


@dataclass
class HostStats:
    lease_ms: list[float] = field(default_factory=list)
    put_ms: list[float] = field(default_factory=list)
    errors: dict[str, float] = field(default_factory=dict)
    relayed_bytes: int = 0


class _TimedStub:
    """The buffer stub of one replica, recording LeasePrompts and PutTrajectories latency (of
    calls that succeeded: a refused lease is the designed backpressure, counted apart)."""

    def __init__(self, stub: Any, stats: HostStats, recording: threading.Event) -> None:
        self._stub, self._stats, self._recording = stub, stats, recording

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        samples = {"LeasePrompts": self._stats.lease_ms, "PutTrajectories": self._stats.put_ms}
        if name not in samples:
            return method

        async def timed(*args: Any, **kw: Any) -> Any:
            started = time.perf_counter()
            answer = await method(*args, **kw)
            if self._recording.is_set():
                samples[name].append((time.perf_counter() - started) * 1e3)
            return answer

        return timed


def _errors() -> dict[str, float]:
    """This process' rollout error counters (backpressure counted apart: it is designed)."""
    from prometheus_client import REGISTRY

    wanted = {
        "kuberl_rollout_failures_total": "failures",
        "kuberl_rollout_rpc_retries_total": "rpc_retries",
        "kuberl_rollout_backpressure_total": "backpressure",
    }
    out: dict[str, float] = dict.fromkeys(wanted.values(), 0.0)
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] += sample.value
    return out


def host_main(inbox: Any, out: Any) -> None:
    """One host process: runs the commands of its inbox (`Pool`) on one event loop."""
    os.environ.setdefault("KUBERL_LOG_LEVEL", "warning")
    asyncio.run(_host(inbox, out))


async def _host(inbox: Any, out: Any) -> None:
    from kuberl.common import modelbuild
    from kuberl.common.config import JobConfig
    from kuberl.common.logs import setup_logging
    from kuberl.common.weights import EngineClient
    from kuberl.rollout.server import RolloutService

    setup_logging("rollout", "warning")
    # One tokenizer object for the host's replicas (each would load the same files): loading
    # hundreds at once was most of the start-up, and transformers' lazy imports race in threads.
    modelbuild.load_tokenizer = functools.lru_cache(modelbuild.load_tokenizer)
    stats, recording = HostStats(), threading.Event()
    services: list[RolloutService] = []
    clients: list[EngineClient] = []
    errors0: dict[str, float] = {}

    async def start(job_data: dict[str, Any], replica_id: str) -> None:
        data = json.loads(json.dumps(job_data))
        data["rollout"]["replica_id"] = replica_id
        service = RolloutService(JobConfig.model_validate(data))
        services.append(service)
        await service.start()
        assert service.worker is not None
        service.worker.buffer = _TimedStub(service.worker.buffer, stats, recording)

    def engine(spec: dict[str, Any], engine_id: str) -> EngineClient:
        return EngineClient(
            spec["address"], load=lambda tensors, version: None, engine_id=engine_id,
            transports=["snapshot"], peer_host="127.0.0.1" if spec["relay"] else "",
            peer_bytes_per_second=spec["pod_bytes_per_second"],
        )  # fmt: skip

    while True:
        command, arg, ids = await asyncio.to_thread(inbox.get)
        if command == "replicas":  # arg: the job file's contents
            modelbuild.load_tokenizer(Path(arg["model"]["path"]))
            await asyncio.gather(*(start(arg, r) for r in ids))
            out.put(("ready", len(ids)))
        elif command == "engines":  # bare weight-sync engines; arg: where and how
            clients = [engine(arg, e) for e in ids]
            await asyncio.gather(*(asyncio.to_thread(c.start) for c in clients))
            out.put(("ready", len(ids)))
        elif command == "measure":
            stats.lease_ms.clear()  # the replicas' stubs hold this object
            stats.put_ms.clear()
            errors0 = _errors()
            recording.set()
            out.put(("measuring", 0))
        elif command == "measured":
            recording.clear()
            errors1 = _errors()
            stats.errors = {k: errors1[k] - errors0[k] for k in errors1}
            out.put(("stats", stats))
        elif command == "stop":
            for service in services:
                if service.worker is not None:
                    service.worker._stopping = True  # no new leases while the others stop
            await asyncio.gather(*(s.stop() for s in services), return_exceptions=True)
            await asyncio.gather(*(asyncio.to_thread(c.stop) for c in clients))
            out.put(("stopped", len(services) + len(clients)))
            services, clients = [], []
        else:
            return


class Pool:
    """Host processes started once (importing torch and kuberl takes each many seconds on a
    busy machine) that host the replicas or engines of one phase after another."""

    def __init__(self, hosts: int) -> None:
        ctx = mp.get_context("spawn")
        self.out = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(hosts)]
        self.procs = [ctx.Process(target=host_main, args=(q, self.out)) for q in self.inboxes]
        for p in self.procs:
            p.start()
        self.busy = 0  # hosts given the current phase

    def start(self, command: str, args: list[Any], ids: list[str], timeout: float = 600) -> None:
        """Spread `ids` over the hosts; host i gets `args[i % len(args)]`."""
        shards = [ids[i :: len(self.procs)] for i in range(len(self.procs))]
        self.busy = sum(1 for s in shards if s)
        for i, shard in enumerate(shards[: self.busy]):
            self.inboxes[i].put((command, args[i % len(args)], shard))
        self.collect("ready", timeout)

    def send(self, command: str, reply: str, timeout: float = 120) -> list[Any]:
        for inbox in self.inboxes[: self.busy]:
            inbox.put((command, None, []))
        return self.collect(reply, timeout)

    def collect(self, what: str, timeout: float) -> list[Any]:
        got: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(got) < self.busy:
            try:
                kind, value = self.out.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"hosts: {len(got)} of {self.busy} sent {what} "
                        f"(exit codes of the dead: {dead})"
                    ) from None
                continue
            if kind != what:
                raise RuntimeError(f"a host sent {kind} while {what} was awaited")
            got.append(value)
        return got

    def stop(self) -> None:
        """End the phase: every replica and engine stops (and leaves)."""
        if self.busy:
            self.send("stop", "stopped")
            self.busy = 0

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(("exit", None, []))
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()


# ---------------------------------------------------------------- the trainer stand-in


class Consumer(threading.Thread):
    """GetBatch acknowledging the previous batch, as the trainer does; counts trajectories."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.trajectories = 0
        self.failures = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        from kuberl.api.buffer.v1 import buffer_pb2 as bpb
        from kuberl.api.buffer.v1 import buffer_pb2_grpc
        from kuberl.common.channels import sync_channel

        acked = ""
        with sync_channel(self.address) as channel:
            stub = buffer_pb2_grpc.BufferServiceStub(channel)
            while not self._stop_event.is_set():
                try:
                    batch = stub.GetBatch(
                        bpb.GetBatchRequest(
                            num_groups=BATCH_GROUPS, max_staleness=-1, consumer="trainer",
                            wait_seconds=0.5, ack_batch_id=acked,
                        ),
                        timeout=60,
                    )  # fmt: skip
                except Exception:
                    self.failures += 1
                    time.sleep(0.2)
                    continue
                acked = batch.batch_id
                self.trajectories += sum(len(g.trajectories) for g in batch.groups)
            if acked:
                stub.Ack(bpb.AckRequest(batch_id=acked), timeout=30)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(60)


# ---------------------------------------------------------------- measuring one N


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


#: The job's keys that hold in-flight groups (leases, waiting groups and their payloads, batches).
INFLIGHT_KEYS = ("leases:train", "groups:train", "payloads:train", "batches:train")


def _machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of every core since boot (/proc/stat)."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _redis_job_bytes(url: str, job: str) -> dict[str, int]:
    """MEMORY USAGE of the job's in-flight keys, and of its idempotency record (`accepted`,
    one field per group ever accepted), exactly (SAMPLES 0)."""
    import redis

    client: Any = redis.Redis.from_url(url)
    prefix = f"kuberl:{{{job}}}:"

    def usage(key: str) -> int:
        return int(client.memory_usage(key, samples=0) or 0)

    batches = [k.decode() for k in client.scan_iter(prefix + "batch:*")]
    payloads = prefix + "payloads:train"
    waiting = int(client.hlen(payloads))
    # The serialized groups themselves (a sample), against what Redis spends on them.
    sample = [k for k, _ in zip(client.hscan_iter(payloads), range(50), strict=False)]
    serialized = sum(int(client.hstrlen(payloads, k)) for k, _ in sample) / max(len(sample), 1)
    return {
        "inflight": sum(usage(prefix + k) for k in INFLIGHT_KEYS) + sum(map(usage, batches)),
        "accepted": usage(prefix + "accepted:train"),
        "accepted_groups": int(client.hlen(prefix + "accepted:train")),
        "waiting_groups": waiting,
        "waiting_bytes": usage(payloads) + usage(prefix + "groups:train"),
        "serialized_group_bytes": round(serialized),
        "leased": int(client.hlen(prefix + "leases:train")),
        "lease_bytes": usage(prefix + "leases:train"),
    }


def _buffer_stats(address: str) -> Any:
    from kuberl.api.buffer.v1 import buffer_pb2 as bpb
    from kuberl.api.buffer.v1 import buffer_pb2_grpc
    from kuberl.common.channels import sync_channel

    with sync_channel(address) as channel:
        return buffer_pb2_grpc.BufferServiceStub(channel).GetStats(
            bpb.GetStatsRequest(), timeout=30
        )


def _buffer_inflight(address: str) -> int:
    """Groups the job holds in Redis now: leased prompts, groups waiting, unacked batches."""
    s = _buffer_stats(address)
    return int(s.prompts_leased + s.groups_pending + s.batches_unacked * BATCH_GROUPS)


def _engines_holding(address: str, version: int) -> int:
    from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
    from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
    from kuberl.common.channels import sync_channel

    with sync_channel(address) as channel:
        status = pb_grpc.WeightSyncServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=30)
    return sum(1 for e in status.engines if e.loaded_version >= version)


def _metric(metrics_port: int, name: str, **labels: str) -> float:
    """A sample's value from a service's /metrics (0 when absent)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    total = 0.0
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def _buckets(metrics_port: int, name: str, **labels: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts (upper bound -> count) from /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name == f"{name}_bucket" and all(
                sample.labels.get(k) == v for k, v in labels.items()
            ):
                le = float(sample.labels["le"])
                out[le] = out.get(le, 0.0) + sample.value
    return out


def bucket_quantiles(before: dict[float, float], after: dict[float, float]) -> dict[str, float]:
    """Upper bounds (ms) of the buckets holding the p50 and p99 of what was observed between
    two readings of a histogram: the buffer's own time per call, without the callers' side."""
    delta = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = delta[-1][1] if delta else 0.0
    out = {}
    for q in (50, 99):
        le = next((le for le, count in delta if count >= total * q / 100), float("inf"))
        out[f"p{q}_le"] = round(le * 1e3, 1)
    return out


def payload(mb: float) -> list[tuple[str, Any]]:
    import torch

    n = int(mb * 1e6) // 2
    return [("w.weight", torch.ones(n // 2, dtype=torch.bfloat16)),
            ("v.weight", torch.zeros(n - n // 2, dtype=torch.bfloat16))]  # fmt: skip


@dataclass
class Stack:
    """Redis and the reward service, shared by every N; a tiny model folder for the tokenizer."""

    workdir: Path
    redis_url: str
    redis_pid: int
    model: Path
    prompts: Path
    reward: ServiceProcess | None = None
    #: How long the services' idle CPU is measured before each N.
    idle_seconds: float = 5.0
    #: The host processes of the replicas and engines.
    pool: Pool | None = None
    #: Where py-spy writes collapsed stacks of the services (None: no profiling).
    profile_dir: Path | None = None


@contextlib.contextmanager
def profiled(stack: Stack, pid: int, name: str) -> Iterator[None]:
    """py-spy samples process `pid` meanwhile (with --profile): collapsed stacks in <name>.txt."""
    if stack.profile_dir is None:
        yield
        return
    stack.profile_dir.mkdir(parents=True, exist_ok=True)
    spy = subprocess.Popen(
        [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--format",
         "raw", "--rate", "50", "--nonblocking", "-o", str(stack.profile_dir / f"{name}.txt")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        spy.wait(30)


def measure(
    stack: Stack, replicas: int, seconds: float, payload_mb: float, work: Workload,
    buffers: int = 1, fan_out: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """One N: start buffer(s) and weight-sync for a fresh job, the replicas, measure, stop."""
    tag = f"n{replicas}-b{buffers}-{int(time.time() * 1000) % 10**8}"
    workdir = stack.workdir / tag
    workdir.mkdir()
    data = job(workdir, tag, stack.redis_url, stack.prompts, stack.model, work)
    config = write_job(workdir / "job.yaml", data)
    env = {"KUBERL_LOG_LEVEL": "warning"}
    procs = [
        ServiceProcess.kuberl("buffer", config, workdir, f"buffer{i}", env) for i in range(buffers)
    ]
    sync = ServiceProcess.kuberl("weight_sync", config, workdir, "weight_sync", env)
    procs.append(sync)
    pool = stack.pool
    assert pool is not None
    try:
        for p in procs:
            p.wait_serving(120)
        assert stack.reward is not None
        endpoints = {
            "buffer": procs[0].address, "reward": stack.reward.address, "weight_sync": sync.address,
        }  # fmt: skip
        consumer = Consumer(procs[0].address)
        consumer.start()
        pids = {"buffer": [p.proc.pid for p in procs[:buffers]], "redis": [stack.redis_pid]}
        pids["weight_sync"] = [sync.proc.pid]
        idle0 = {k: sum(_proc_cpu_seconds(p) for p in v) for k, v in pids.items()}
        time.sleep(stack.idle_seconds)  # what the services cost with no replica: subtracted below
        idle = {
            k: (sum(_proc_cpu_seconds(p) for p in v) - idle0[k]) / stack.idle_seconds
            for k, v in pids.items()
        }
        # With two buffer replicas, half the hosts' replicas talk to each (as a Service would
        # spread them).
        shards = []
        for i in range(buffers):
            d = json.loads(json.dumps(data))
            d["endpoints"] = {**endpoints, "buffer": procs[i].address}
            shards.append(d)
        t_start = time.perf_counter()
        pool.start("replicas", shards, [f"{tag}-r{i}" for i in range(replicas)])
        startup_s = time.perf_counter() - t_start
        # Warm up: the first lease queues the epoch (one Redis script over every prompt, which
        # holds Redis meanwhile), then the first batches.
        deadline = time.monotonic() + 120
        while _buffer_stats(procs[0].address).cursor == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(min(5.0, seconds / 3))
        pids["replica_hosts"] = [p.pid for p in pool.procs[: pool.busy] if p.pid]
        pids["reward"] = [stack.reward.proc.pid]
        cpu0 = {k: sum(_proc_cpu_seconds(p) for p in v) for k, v in pids.items()}
        box0 = _machine_busy()
        traj0 = consumer.trajectories
        pool.send("measure", "measuring")
        t0 = time.perf_counter()
        rpc = "kuberl_buffer_rpc_seconds"
        served0 = {m: _buckets(procs[0].metrics_port, rpc, method=m) for m in BUFFER_CALLS}
        with profiled(stack, procs[0].proc.pid, f"buffer-n{replicas}-b{buffers}"):
            time.sleep(seconds)
        served1 = {m: _buckets(procs[0].metrics_port, rpc, method=m) for m in BUFFER_CALLS}
        inflight = _buffer_inflight(procs[0].address)
        memory = _redis_job_bytes(stack.redis_url, tag)
        elapsed = time.perf_counter() - t0
        traj = consumer.trajectories - traj0
        cpu = {k: sum(_proc_cpu_seconds(p) for p in v) - cpu0[k] for k, v in pids.items()}
        box1 = _machine_busy()
        host_stats: list[HostStats] = pool.send("measured", "stats")
        lease = [x for s in host_stats for x in s.lease_ms]
        put = [x for s in host_stats for x in s.put_ms]
        errors: dict[str, float] = {}
        for s in host_stats:
            for k, v in s.errors.items():
                errors[k] = errors.get(k, 0) + v
        per_1k = 1e6 / max(traj, 1)
        result: dict[str, Any] = {
            "replicas": replicas,
            "buffers": buffers,
            "startup_seconds": round(startup_s, 1),
            "window_seconds": round(elapsed, 1),
            "trajectories": traj,
            "traj_per_s": round(traj / elapsed, 1),
            "lease_ms": {"p50": round(percentile(lease, 50), 2),
                         "p99": round(percentile(lease, 99), 2), "calls": len(lease)},
            # The same calls timed inside the buffer (its rpc histogram's buckets): what the
            # buffer itself takes, apart from the callers' and the machine's queueing.
            "buffer_side_ms": {
                m: bucket_quantiles(served0[m], served1[m]) for m in BUFFER_CALLS
            },
            "put_ms": {"p50": round(percentile(put, 50), 2),
                       "p99": round(percentile(put, 99), 2), "calls": len(put)},
            "cpu_ms_per_1k_traj": {
                "buffer": round(cpu["buffer"] * per_1k, 1),
                "redis": round(cpu["redis"] * per_1k, 1),
                "buffer_plus_redis": round((cpu["buffer"] + cpu["redis"]) * per_1k, 1),
            },
            # Cores busy per role over the window, and the whole machine's (other users too).
            "cpu_share": {k: round(v / elapsed, 3) for k, v in cpu.items()},
            "machine_busy_cores": round(
                (box1[0] - box0[0]) / max(box1[1] - box0[1], 1e-9) * (os.cpu_count() or 1), 2
            ),
            "weight_sync_cpu_ms_per_engine_per_s": round(
                cpu["weight_sync"] * 1e3 / elapsed / replicas, 3
            ),
            # (0 where the idle reading, a few clock ticks, was above the window's)
            "cpu_ms_per_1k_traj_above_idle": {
                k: round(max(0.0, cpu[k] - idle[k] * elapsed) * per_1k, 1)
                for k in ("buffer", "redis")
            },
            "idle_cpu_share": {k: round(v, 4) for k, v in idle.items()},
            "redis_bytes_per_inflight_group": round(memory["inflight"] / max(inflight, 1)),
            # Groups put and not yet taken by the trainer: Redis bytes per serialized byte.
            "redis_waiting_groups": memory["waiting_groups"],
            "redis_serialized_group_bytes": memory["serialized_group_bytes"],
            "redis_bytes_per_serialized_byte": round(
                memory["waiting_bytes"]
                / max(memory["waiting_groups"] * memory["serialized_group_bytes"], 1),
                2,
            )
            if memory["waiting_groups"]
            else None,
            "redis_bytes_per_lease": round(memory["lease_bytes"] / max(memory["leased"], 1)),
            "inflight_groups": inflight,
            "redis_bytes_per_accepted_group": round(
                memory["accepted"] / max(memory["accepted_groups"], 1)
            ),
            "errors": {k: int(v) for k, v in errors.items() if k != "backpressure"},
            "backpressure": int(errors.get("backpressure", 0)),
            "consumer_failures": consumer.failures,
        }  # fmt: skip
        if fan_out:
            result["fan_out"] = fan_out_once(sync, replicas, payload_mb)
        pool.stop()
        consumer.stop()
        return result
    finally:
        pool.stop()
        for p in procs:
            p.stop()


def fan_out_once(sync: ServiceProcess, engines: int, payload_mb: float) -> dict[str, Any]:
    """Publish one version and time it until every engine holds it."""
    from kuberl.common.weights import WeightPublisher

    sent0 = _metric(sync.metrics_port, "kuberl_weight_sync_bytes_total", direction="out")
    publisher = WeightPublisher(sync.address, transports=("snapshot",), host="trainer-host")
    tensors = payload(payload_mb)
    published = publisher.publish(1, tensors)
    t0 = time.perf_counter()
    deadline = t0 + 300
    holding = 0
    while time.perf_counter() < deadline:
        holding = _engines_holding(sync.address, 1)
        if holding >= engines:
            break
        time.sleep(0.1)
    seconds = time.perf_counter() - t0
    sent = _metric(sync.metrics_port, "kuberl_weight_sync_bytes_total", direction="out") - sent0
    relayed = _metric(sync.metrics_port, "kuberl_weight_sync_relayed_bytes_total")
    return {
        "payload_bytes": published.total_bytes,
        "seconds": round(seconds, 2),
        "engines_holding": holding,
        "weight_sync_bytes_sent": int(sent),
        "weight_sync_bytes_per_engine": int(sent / max(engines, 1)),
        "relayed_bytes": int(relayed),
    }


def fan_out_phase(
    stack: Stack, engines: int, payload_mb: float, relay_fanout: int, work: Workload,
    pod_bytes_per_second: float,
) -> dict[str, Any]:  # fmt: skip
    """Weight-sync alone with `engines` bare engines: one version's fan-out, star or relay,
    every pod's snapshot streams capped at `pod_bytes_per_second` (its NIC, in this model)."""
    tag = f"fan{engines}-k{relay_fanout}-{int(time.time() * 1000) % 10**8}"
    workdir = stack.workdir / tag
    workdir.mkdir()
    data = job(workdir, tag, stack.redis_url, stack.prompts, stack.model, work)
    data["weight_sync"]["relay_fanout"] = relay_fanout
    data["weight_sync"]["snapshot_bytes_per_second"] = pod_bytes_per_second
    config = write_job(workdir / "job.yaml", data)
    with ServiceProcess.kuberl("weight_sync", config, workdir, "weight_sync") as sync:
        sync.wait_serving(120)
        spec = {
            "address": sync.address,
            "relay": relay_fanout > 0,
            "pod_bytes_per_second": pod_bytes_per_second,
        }
        assert stack.pool is not None
        try:
            stack.pool.start("engines", [spec], [f"{tag}-e{i}" for i in range(engines)])
            cpu0 = _proc_cpu_seconds(sync.proc.pid)
            with profiled(stack, sync.proc.pid, f"weight_sync-fan{engines}-k{relay_fanout}"):
                result = fan_out_once(sync, engines, payload_mb)
            result["weight_sync_cpu_seconds"] = round(_proc_cpu_seconds(sync.proc.pid) - cpu0, 2)
        finally:
            stack.pool.stop()
    return {"engines": engines, "relay_fanout": relay_fanout, **result}


def start_stack(workdir: Path, redis_url: str, redis_pid: int, work: Workload) -> Stack:
    from tests.tiny_models import save_tiny_model

    model = save_tiny_model(workdir / "model", hidden_size=16, layers=1, heads=2, kv_heads=1)
    prompts = workdir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}"}) + "\n" for i in range(30_000)))
    stack = Stack(workdir, redis_url, redis_pid, model, prompts)
    data = job(workdir, "reward", redis_url, prompts, model, work)
    config = write_job(workdir / "reward.yaml", data)
    stack.reward = ServiceProcess.kuberl("reward", config, workdir, "reward")
    stack.reward.wait_serving(120)
    return stack


def summarize(
    runs: list[dict[str, Any]], fan: dict[str, dict[str, Any]], two: dict[str, Any] | None
) -> dict[str, Any]:
    base, top = runs[0], runs[-1]
    cpu_ratio = (
        top["cpu_ms_per_1k_traj"]["buffer_plus_redis"]
        / base["cpu_ms_per_1k_traj"]["buffer_plus_redis"]
    )
    p99 = max(top["lease_ms"]["p99"], top["put_ms"]["p99"])
    by_n = {r["replicas"]: r for r in runs}
    relay = {int(n): x["seconds"] for n, x in fan.get("relay", {}).items()}
    star = {int(n): x["seconds"] for n, x in fan.get("star", {}).items()}
    fan_ratio = relay[64] / relay[4] if 64 in relay and 4 in relay else None
    star_ratio = star[64] / star[4] if 64 in star and 4 in star else None
    registry = {n: r["weight_sync_cpu_ms_per_engine_per_s"] for n, r in by_n.items()}
    reg_ratio = registry[256] / registry[16] if 256 in registry and 16 in registry else None
    errors = sum(sum(r["errors"].values()) + r["consumer_failures"] for r in runs)
    out: dict[str, Any] = {
        "largest_replicas": top["replicas"],
        "p99_ms_at_largest": p99,
        "cpu_per_1k_ratio_largest_to_smallest": round(cpu_ratio, 3),
        # The same without what the services cost idle (a fixed cost the few trajectories of a
        # small N carry alone): the cost that grows with the replicas.
        "cpu_per_1k_above_idle_ratio": round(
            sum(top["cpu_ms_per_1k_traj_above_idle"].values())
            / sum(base["cpu_ms_per_1k_traj_above_idle"].values()),
            3,
        )
        if sum(base["cpu_ms_per_1k_traj_above_idle"].values()) > 0
        else None,
        "fan_out_ratio_64_to_4": None if fan_ratio is None else round(fan_ratio, 2),
        "star_fan_out_ratio_64_to_4": None if star_ratio is None else round(star_ratio, 2),
        "registry_cost_ratio_256_to_16": None if reg_ratio is None else round(reg_ratio, 2),
        "errors_besides_backpressure": int(errors),
    }
    goals = {
        "p99_ms": p99 <= GOAL_P99_MS,
        "cpu_ratio": cpu_ratio <= GOAL_CPU_RATIO,
        "no_errors": errors == 0,
    }
    if fan_ratio is not None:
        goals["fan_out_ratio"] = fan_ratio <= GOAL_FANOUT_RATIO
    if reg_ratio is not None:
        goals["registry_flat"] = reg_ratio <= 1.5
    if two is not None:
        ratio = two["two"]["traj_per_s"] / max(two["one"]["traj_per_s"], 1e-9)
        out["two_buffers_ratio"] = round(ratio, 2)
        goals["two_buffers"] = ratio >= GOAL_TWO_BUFFERS
    out["goals_met"] = goals
    return out


# -- the projection of docs/scale.md: a 7B job on 512 GPUs, from this run's constants ------------

#: Measured elsewhere on this machine: benchmarks/buffer_throughput.py of 2026-11-27 03:57 UTC
#: (idle box, docs/benchmarks.jsonl): CPU per 1,000 trajectories of 2,048 response tokens,
#: 19,047 bytes each on the wire, put 64 at a time (8 groups of 8).
BUFFER_THROUGHPUT = {"buffer_ms": 56.3, "redis_ms": 33.6, "bytes": 19_047, "per_call": 64}
#: Published: slime moves GLM-4.5-355B (bf16, 710 GB) to its engines in 48 s; checkpoint-engine a
#: 1T-parameter model (2 TB) in about 20 s. Effective bytes per second of one version's update.
PUBLISHED_UPDATE_BYTES_PER_S = {"slime": 710e9 / 48, "checkpoint_engine": 2e12 / 20}
#: Assumed, not measured here (no GPU): the job's inputs. Decode rate of a 7B model per H100 at
#: 8k-token responses and large batch; the trainer's MFU; its batch.
JOB = {
    "params": 7e9,
    "bytes_per_param": 2,
    "trainer_gpus": 64,
    "rollout_gpus": 448,
    "tp8_replicas": 56,
    "response_tokens": 8192,
    "prompt_tokens": 512,
    "decode_tokens_per_s_per_gpu": 5000.0,
    "group_size": 8,
    "prompts_per_put": 8,
    "groups_per_step": 512,
    "max_staleness": 1,
    "trainer_mfu": 0.4,
    "gpu_peak_flops": 989e12,
    "relay_fanout": 2,
}


def project(result: dict[str, Any]) -> dict[str, Any]:
    """docs/scale.md's projection: every figure from a named constant of this run, of
    `BUFFER_THROUGHPUT`, `PUBLISHED_UPDATE_BYTES_PER_S` or the assumed `JOB`."""
    j, bt = JOB, BUFFER_THROUGHPUT
    top = result["runs"][-1]
    # Bytes per trajectory on the wire: int32 ids + fp32 logprobs + uint8 mask per response
    # token, int32 per prompt token, and buffer_throughput's measured per-trajectory rest.
    rest = bt["bytes"] - 2048 * 9 - 128 * 4
    traj_bytes = j["response_tokens"] * 9 + j["prompt_tokens"] * 4 + rest
    # CPU per trajectory = per call / trajectories per call + per byte x bytes, solved from two
    # measurements: this run's largest N (small trajectories, few per call) and buffer_throughput.
    per_call_here = GROUP_SIZE * PROMPTS_PER_BATCH
    # Redis' cost of a stored group, from the runs in which groups waited for the trainer.
    stored = [
        r
        for r in [*result["runs"], *(result.get("buffers_at_largest") or {}).values()]
        if r.get("redis_bytes_per_serialized_byte")
    ]
    sized = max(stored, key=lambda r: r["redis_waiting_groups"]) if stored else None
    here_bytes = (sized or top).get("redis_serialized_group_bytes", 0) / GROUP_SIZE
    cpu: dict[str, dict[str, float]] = {}
    for role, key in (("buffer", "buffer_ms"), ("redis", "redis_ms")):
        here = top["cpu_ms_per_1k_traj_above_idle"][role] / 1e3  # ms per trajectory
        there = bt[key] / 1e3
        # here = c / per_call_here + b * here_bytes; there = c / bt_per_call + b * bt_bytes
        a11, a12, a21, a22 = 1 / per_call_here, here_bytes, 1 / bt["per_call"], bt["bytes"]
        det = a11 * a22 - a12 * a21
        c = (here * a22 - a12 * there) / det
        b = (a11 * there - a21 * here) / det
        per_traj = c / (j["group_size"] * j["prompts_per_put"]) + b * traj_bytes
        cpu[role] = {"ms_per_call": round(c, 3), "us_per_kb": round(b * 1e6, 3),
                     "ms_per_traj": round(per_traj, 4)}  # fmt: skip
    traj_s = j["rollout_gpus"] * j["decode_tokens_per_s_per_gpu"] / j["response_tokens"]
    group_bytes = traj_bytes * j["group_size"]
    overhead = sized["redis_bytes_per_serialized_byte"] if sized else float("nan")
    lease_bytes = top["redis_bytes_per_lease"]
    waiting_groups = (1 + j["max_staleness"]) * j["groups_per_step"]
    # Every single-GPU replica holds batches_in_flight (2) x prompts_per_batch leases.
    leases = j["rollout_gpus"] * 2 * j["prompts_per_put"]
    model_bytes = j["params"] * j["bytes_per_param"]
    step_tokens = (
        j["groups_per_step"] * j["group_size"] * (j["response_tokens"] + j["prompt_tokens"])
    )
    step_s = (
        6 * j["params"] * step_tokens / (j["trainer_gpus"] * j["gpu_peak_flops"] * j["trainer_mfu"])
    )
    ws_cpu = top["weight_sync_cpu_ms_per_engine_per_s"] / 1e3
    stream = result["fan_out"].get("single_stream_mb_per_s", 0) * 1e6
    k = j["relay_fanout"]
    slime = PUBLISHED_UPDATE_BYTES_PER_S["slime"]
    sync: dict[str, Any] = {}
    for layout, engines in (("tp8", j["tp8_replicas"]), ("single_gpu", j["rollout_gpus"])):
        rounds = math.ceil(math.log(engines + 1) / math.log(k + 1))
        sync[layout] = {
            "engines": engines,
            "nccl_one_group_per_engine_s": round(engines * model_bytes / slime, 1),
            "nccl_one_broadcast_s": round(model_bytes / slime, 2),
            "snapshot_star_s": round(engines * model_bytes / stream, 0) if stream else None,
            "snapshot_relay_rounds": rounds,
            # Each round, a source streams to k at once at what one stream moves here in all.
            "snapshot_relay_s": round(rounds * k * model_bytes / stream, 0) if stream else None,
            "heartbeat_cores": round(engines * ws_cpu, 3),
        }
    # Each component's load against its budget (1.0 = saturated): Redis and weight-sync's event
    # loop have one core each, a buffer replica one core; a version's update must fit in a step
    # (SGLang engines take NCCL from a relay with a GPU, one group per engine).
    loads = {
        "redis_core": traj_s * cpu["redis"]["ms_per_traj"] / 1e3,
        "buffer_core_one_replica": traj_s * cpu["buffer"]["ms_per_traj"] / 1e3,
        "weight_sync_heartbeat_core": sync["single_gpu"]["heartbeat_cores"],
        "nccl_update_vs_step_tp8": sync["tp8"]["nccl_one_group_per_engine_s"] / step_s,
        "nccl_update_vs_step_single_gpu": sync["single_gpu"]["nccl_one_group_per_engine_s"]
        / step_s,
    }
    return {
        "inputs": {"job": j, "buffer_throughput": bt, "published": PUBLISHED_UPDATE_BYTES_PER_S},
        "trajectory_bytes": traj_bytes,
        "trajectories_per_s": round(traj_s, 1),
        "buffer_mb_per_s_in_and_out": round(traj_s * traj_bytes / 1e6, 1),
        "cpu_model": cpu,
        "buffer_cores": round(loads["buffer_core_one_replica"], 3),
        "redis_core_share": round(loads["redis_core"], 3),
        "redis_bytes_per_serialized_byte": overhead,
        "redis_waiting_groups": waiting_groups,
        "redis_leases": leases,
        "redis_gb_at_staleness": round(
            (waiting_groups * group_bytes * overhead + leases * lease_bytes) / 1e9, 2
        ),
        "trainer_step_s": round(step_s, 1),
        "weight_sync": sync,
        "load_vs_budget": {key: round(v, 3) for key, v in loads.items()},
        "first_to_saturate": max(loads, key=lambda key: loads[key]),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """The curves of docs/scale.md: latency, CPU per trajectory, fan-out, registry cost vs N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    n = [r["replicas"] for r in runs]
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    a = ax[0][0]
    for call, style in (("lease_ms", "o-"), ("put_ms", "s-")):
        for q in ("p50", "p99"):
            a.plot(n, [r[call][q] for r in runs], style, label=f"{call[:-3]} {q}",
                   alpha=1.0 if q == "p99" else 0.5)  # fmt: skip
    for call, style in (("LeasePrompts", "o:"), ("PutTrajectories", "s:")):
        inside = [r.get("buffer_side_ms", {}).get(call, {}).get("p99_le") for r in runs]
        a.plot(n, inside, style, label=f"{call} p99, inside the buffer (bucket)")
    a.axhline(GOAL_P99_MS, color="grey", ls=":", label="goal p99")
    a.set(title="buffer calls seen by the replicas", ylabel="ms")
    a = ax[0][1]
    a.plot(n, [r["cpu_ms_per_1k_traj"]["buffer"] for r in runs], "o-", label="buffer")
    a.plot(n, [r["cpu_ms_per_1k_traj"]["redis"] for r in runs], "s-", label="Redis")
    a.set(title="CPU per 1,000 trajectories", ylabel="CPU ms")
    b = a.twinx()
    b.plot(n, [r["traj_per_s"] for r in runs], "k--", label="trajectories/s")
    b.set_ylabel("trajectories/s")
    b.legend(loc="center right")
    a = ax[1][0]
    for name, style in (("star", "o-"), ("relay", "s-")):
        by_n = result.get("fan_out", {}).get(name, {})
        ns = sorted(int(k) for k in by_n)
        a.plot(ns, [by_n[str(k)]["seconds"] for k in ns], style, label=f"{name}: time")
    phase = result["workload"].get("fan_out_phase", {})
    a.set(
        title=f"one version ({phase.get('payload_mb', 0)} MB) to N engines\n(each pod's egress "
        f"capped at {phase.get('pod_mb_per_s', 0)} MB/s)",
        ylabel="seconds",
    )
    a = ax[1][1]
    a.plot(n, [r["weight_sync_cpu_ms_per_engine_per_s"] for r in runs], "o-", label="per engine")
    a.set(title="weight-sync CPU per engine (heartbeats, registry)", ylabel="CPU ms / s")
    a.set_ylim(bottom=0)
    for a in (ax[0][0], ax[0][1], ax[1][0], ax[1][1]):
        a.set_xscale("log", base=2)
        a.set_xlabel("rollout replicas / engines (N)")
        a.legend(loc="upper left", fontsize=8)
    load = result["machine"]
    fig.suptitle(
        f"kuberl scale, simulated replicas ({load['cores']}-core {load['cpu']}, shared: "
        f"load {load['loadavg_1m_at_start']}-{load['loadavg_1m_at_end']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--hosts", type=int, default=4, help="replica host processes")
    parser.add_argument("--seconds", type=float, default=20.0, help="steady window per N")
    parser.add_argument("--payload-mb", type=float, default=8.0, help="weights of one version")
    parser.add_argument("--tokens-per-second", type=float, default=40.0, help="per sequence")
    parser.add_argument("--response-tokens", type=int, default=128, help="median length")
    parser.add_argument(
        "--saturate-seconds", type=float, default=15.0, help="window of the 1 vs 2 buffers phase"
    )
    parser.add_argument("--no-saturate", action="store_true", help="skip the 1 vs 2 buffers phase")
    parser.add_argument(
        "--no-fan-out",
        action="store_true",
        help="skip every fan-out (after each N and the fan-out phase): latency and CPU only",
    )
    parser.add_argument(
        "--fan-out-mb", type=float, default=0.5, help="weights of one version, fan-out phase"
    )
    parser.add_argument(
        "--pod-mb-per-s",
        type=float,
        default=1.0,
        help="fan-out phase: each pod's snapshot egress cap (weight_sync.snapshot_bytes_per_second)"
        ", low enough that all pods together stay under what this machine can copy",
    )
    parser.add_argument(
        "--star-up-to", type=int, default=64, help="fan-out phase: largest N timed as a star"
    )
    parser.add_argument(
        "--idle-seconds", type=float, default=5.0, help="services' idle CPU, measured per N"
    )
    parser.add_argument("--profile", type=Path, help="py-spy the services into this folder")
    parser.add_argument("--plot", type=Path, help="write the curves to this PNG")
    parser.add_argument(
        "--plot-from", type=Path, help="only plot (to --plot) the last JSON line of this file"
    )
    parser.add_argument(
        "--relay-fanout", type=int, default=2, help="weight_sync.relay_fanout (0: the star)"
    )
    args = parser.parse_args(argv)
    if args.plot_from:
        plot(json.loads(args.plot_from.read_text().strip().splitlines()[-1]), args.plot)
        return 0

    from kuberl.common.redis_server import EmbeddedRedis

    info = machine()
    work = Workload(
        tokens_per_second=args.tokens_per_second,
        response_tokens=args.response_tokens,
        relay_fanout=args.relay_fanout,
    )
    runs: list[dict[str, Any]] = []
    two: dict[str, Any] | None = None
    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis(Path(tmp) / "redis", die_with_parent=True) as redis_server,
    ):
        assert redis_server.proc is not None
        pool = Pool(args.hosts)  # its imports overlap the services' start
        stack = start_stack(Path(tmp), redis_server.url, redis_server.proc.pid, work)
        stack.profile_dir, stack.pool, stack.idle_seconds = args.profile, pool, args.idle_seconds
        try:
            for n in args.replicas:
                run = measure(
                    stack, n, args.seconds, args.payload_mb, work, fan_out=not args.no_fan_out
                )
                runs.append(run)
                fanned = f"fan-out {run['fan_out']['seconds']} s " if "fan_out" in run else ""
                print(
                    f"N={n}: {run['traj_per_s']} traj/s, lease p99 {run['lease_ms']['p99']} ms, "
                    f"put p99 {run['put_ms']['p99']} ms, {fanned}"
                    f"(load {os.getloadavg()[0]:.1f})",
                    file=sys.stderr,
                )
            fan: dict[str, Any] = {}
            if not args.no_fan_out:
                # One engine, no cap: what one snapshot stream moves on this machine.
                one = fan_out_phase(stack, 1, 8 * args.payload_mb, 0, work, 0.0)
                mb_per_s = one["payload_bytes"] / one["seconds"] / 1e6
                fan["single_stream_mb_per_s"] = round(mb_per_s, 1)
                for name, k in (("star", 0), ("relay", args.relay_fanout)):
                    fan[name] = {}
                    for n in args.replicas:
                        if k == 0 and n > args.star_up_to:
                            continue  # N x size / the cap: predictable, and long
                        x = fan_out_phase(
                            stack, n, args.fan_out_mb, k, work, args.pod_mb_per_s * 1e6
                        )
                        fan[name][str(n)] = x
                        print(
                            f"fan-out {name} to {n}: {x['seconds']} s, weight-sync sent "
                            f"{x['weight_sync_bytes_sent'] / 1e6:.0f} MB "
                            f"(load {os.getloadavg()[0]:.1f})",
                            file=sys.stderr,
                        )
            if not args.no_saturate:
                # The buffer as the bound: engines 50x faster than above.
                fast = Workload(
                    tokens_per_second=args.tokens_per_second * 50,
                    response_tokens=args.response_tokens,
                )
                n = args.replicas[-1]
                two = {
                    f"{name}": measure(
                        stack, n, args.saturate_seconds, 0, fast, buffers=b, fan_out=False
                    )
                    for name, b in (("one", 1), ("two", 2))
                }  # fmt: skip
                print(
                    f"buffers at N={n}: one {two['one']['traj_per_s']} traj/s, "
                    f"two {two['two']['traj_per_s']} traj/s",
                    file=sys.stderr,
                )
        finally:
            pool.close()
            assert stack.reward is not None
            stack.reward.stop()
    result = {
        "benchmark": "scale",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workload": {
            "group_size": GROUP_SIZE,
            "prompts_per_batch": PROMPTS_PER_BATCH,
            "tokens_per_second_per_sequence": work.tokens_per_second,
            "response_tokens_median": work.response_tokens,
            "length_sigma": work.length_sigma,
            "payload_mb": args.payload_mb,
            "fan_out_phase": {
                "payload_mb": args.fan_out_mb,
                "pod_mb_per_s": args.pod_mb_per_s,
                "relay_fanout": args.relay_fanout,
            },
            "hosts": args.hosts,
            "window_seconds": args.seconds,
        },
        "runs": runs,
        "fan_out": fan,
        "buffers_at_largest": two,
        "summary": summarize(runs, fan, two),
        "projection_7b_512_gpus": project(
            {"runs": runs, "fan_out": fan, "buffers_at_largest": two}
        ),
        "seconds": round(time.perf_counter() - started, 1),
        "machine": {**info, "loadavg_1m_at_end": round(os.getloadavg()[0], 2)},
    }
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
