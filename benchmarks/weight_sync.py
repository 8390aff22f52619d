"""Weight-sync benchmark: time to move a 0.5B-parameter-sized set of bf16 tensors (~1 GB, the
shapes of Qwen2.5-0.5B) from a trainer process to 1, 2 and 4 engine processes through the real
weight-sync service, until every engine holds the new version.

Transports: `gloo` (trainer -> relay by shared memory, relay -> engines by per-engine gloo broadcast
groups), `shm` (the trainer writes the version once into the relay's shared memory; every engine
maps it read-only and copies it into its own double buffer, in parallel) and `shm_in_place` (the
same, but engines serve from the shared mapping itself: no copy, one copy of the weights in memory
for all engines of the host). Each engine process holds parameters of the model's shapes and loads
every version with the torch engine's own `load_state(borrow=True)`, as a rollout replica does.
Baseline, measured in the same run: one raw `torch.distributed.broadcast` (gloo) of the same bytes
between two processes. Goal: 4 engines within 1.5x of the raw pair. With `--gpu`, a CUDA IPC update
of the same tensors into a torch engine on the same GPU (another process, through the engine
client's receiver) is compared to one device-to-device copy of the same bytes (goal 2x); without
CUDA that part reports skipped. Prints one JSON object as its last line, with the load average at
the start and the end (the test machine is shared).

    .venv/bin/python benchmarks/weight_sync.py [--gb 1.0] [--engines 1 2 4] [--repeat 2] [--gpu]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GB = 1e9


def qwen05b_shapes(gb: float) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2.5-0.5B's parameter shapes (~0.99 GB in bf16), scaled to about `gb`."""
    scale = gb / 0.988
    hidden, inter, kv = 896, 4864, 128
    layers = max(1, round(24 * scale))
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (max(1024, int(151936 * scale)), hidden))
    ]
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.self_attn.q_proj.weight", (hidden, hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv, hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, hidden)),
            (f"{p}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{p}.mlp.up_proj.weight", (inter, hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, inter)),
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
        ]
    return [*shapes, ("model.norm.weight", (hidden,))]


def make_tensors(gb: float, version: int) -> dict[str, torch.Tensor]:
    return {
        name: torch.full(shape, float(version % 7 + i % 5), dtype=torch.bfloat16)
        for i, (name, shape) in enumerate(qwen05b_shapes(gb))
    }


# ---------------------------------------------------------------- child processes


def _engine(address: str, name: str, gb: str, in_place: str = "0") -> None:
    from kuberl.common.weights import EngineClient
    from kuberl.rollout.engine.torch_engine import load_state

    # The model's parameters (touched memory, as a loaded model's are), loaded by the torch
    # engine's own `load_state` with `borrow=True`, as the rollout service does: parameters of
    # the published dtype point at the client's tensors, so the engine copies nothing itself.
    params = make_tensors(float(gb), 0)
    borrowed = [False]

    def load(tensors: dict[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            borrowed[0] = load_state(
                params, list(tensors.items()), borrow=True, borrowed=borrowed[0]
            )

    client = EngineClient(address, load=load, engine_id=name, shm_in_place=in_place == "1")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client.start()
    stop.wait()
    client.stop()


def _raw_pair(rank: int, port: int, nbytes: int, out: str) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=120))
    group = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=300))
    flat = (
        torch.ones(nbytes, dtype=torch.uint8)
        if rank == 0
        else torch.empty(nbytes, dtype=torch.uint8)
    )
    flat.zero_() if rank else None  # touch the pages so page faults are not timed
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    times = []
    for _ in range(2):
        group.barrier().wait()
        started = time.perf_counter()
        group.broadcast([flat], opts).wait()
        group.barrier().wait()  # the sender returns early; count until the receiver has it all
        times.append(time.perf_counter() - started)
    if rank == 1:
        Path(out).write_text(json.dumps({"seconds": min(times)}))


def raw_pair_seconds(nbytes: int) -> float:
    from kuberl.common.redis_server import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/raw.json"
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--raw-rank", str(r), str(port), str(nbytes), out]
            )
            for r in (0, 1)
        ]
        for p in procs:
            if p.wait(600) != 0:
                raise RuntimeError("raw broadcast pair failed")
        return float(json.loads(Path(out).read_text())["seconds"])


# ---------------------------------------------------------------- relay runs


def relay_run(
    gb: float,
    transport: str,
    engines: int,
    repeat: int,
    *,
    make: Callable[[int], dict[str, torch.Tensor]] | None = None,
    engine_command: Callable[[str, int], list[str]] | None = None,
) -> dict[str, float]:
    """Best of `repeat` versions (after two warm-up ones) published through a real weight-sync
    service to `engines` engine processes, until all of them report it loaded. `make(version)`:
    the version's tensors (default: `make_tensors(gb, version)`); `engine_command(address, i)`:
    engine i's command line (default: this script's torch-engine-like `_engine`)."""
    from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
    from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
    from kuberl.common.channels import sync_channel
    from kuberl.common.weights import WeightPublisher
    from tests.support import ServiceProcess

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        config = work / "job.yaml"
        config.write_text(
            json.dumps(
                {
                    "job": {"name": f"bench-{uuid.uuid4().hex[:6]}"},
                    "weight_sync": {
                        "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
                        # the trainer hands over by shared memory in both settings
                        "transports": [transport.removesuffix("_in_place"), "shm", "snapshot"],
                        "bucket_bytes": BUCKET_BYTES,
                        "retain_versions": 1,
                        "broadcast_timeout_seconds": 300,
                        "advertise_host": "127.0.0.1",
                        "notify_engines": False,
                    },
                }
            )
        )
        with ServiceProcess.kuberl("weight_sync", config, work) as svc:
            svc.wait_serving()
            default_command = [__file__, "--engine", svc.address]
            in_place = str(int(transport == "shm_in_place"))
            procs = [
                subprocess.Popen(
                    engine_command(svc.address, i)
                    if engine_command
                    else [sys.executable, *default_command, f"e{i}", str(gb), in_place],
                    stdout=subprocess.DEVNULL,
                    stderr=(work / f"e{i}.log").open("wb"),
                )
                for i in range(engines)
            ]
            try:
                with sync_channel(svc.address) as channel, WeightPublisher(svc.address) as pub:
                    stub = pb_grpc.WeightSyncServiceStub(channel)

                    def status() -> pb.GetStatusResponse:
                        return stub.GetStatus(pb.GetStatusRequest(), timeout=10)

                    while len(status().engines) < engines:
                        time.sleep(0.1)
                    # versions 1 and 2 warm up: the first allocation of the relay's segments and
                    # of both halves of each engine's double buffer (cold: see docs/weight-sync.md)
                    results = []
                    for version in range(1, repeat + 3):
                        tensors = make(version) if make else make_tensors(gb, version)
                        started = time.perf_counter()
                        sent = pub.publish(version, iter(tensors.items()))
                        returned = time.perf_counter() - started
                        while min(e.loaded_version for e in status().engines) < version:
                            time.sleep(0.005)
                        total = time.perf_counter() - started
                        del tensors
                        if version > 2:
                            results.append((total, returned, sent.total_bytes))
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    p.wait(30)
        best = min(results)
        return {"seconds": best[0], "trainer_blocked_seconds": best[1], "bytes": best[2]}


BUCKET_BYTES = 256 * 1024 * 1024


def _gpu_engine(gb: float, repeat: int) -> None:
    """The engine side of the GPU part: open each set of CUDA IPC handles the way the engine
    client does (CudaIpcReceiver into a reused double buffer), then load the tensors into
    preallocated parameters the way the torch engine does (one copy_ per tensor)."""
    from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
    from kuberl.common.weights import plan
    from kuberl.common.weights.transports import BufferPool
    from kuberl.common.weights.transports.cuda_ipc import CudaIpcReceiver, split_cuda_ipc

    shapes = qwen05b_shapes(gb)
    manifest = plan([(n, torch.bfloat16, s) for n, s in shapes], BUCKET_BYTES)
    params = {n: torch.empty(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes}
    sets = split_cuda_ipc(sys.stdin.readline(), manifest)
    receiver, pool = CudaIpcReceiver("cuda"), BufferPool()
    receive_s, load_s = [], []
    for handles in sets:
        instruction = pb.UpdateInstruction(
            version=1, transport=pb.TRANSPORT_CUDA_IPC, manifest=manifest.to_proto(),
            handles_json=handles.to_json(),
        )  # fmt: skip
        torch.cuda.synchronize()
        started = time.perf_counter()
        _, flat = receiver.receive(instruction, pool)  # synchronizes
        received = time.perf_counter()
        for name, tensor in manifest.views(flat).items():
            params[name].copy_(tensor)
        torch.cuda.synchronize()
        loaded = time.perf_counter()
        pool.hold(flat)
        receive_s.append(received - started)
        load_s.append(loaded - started)
        equal = all(torch.equal(params[n], t) for n, t in manifest.views(flat).items())
        if not equal:
            raise SystemExit("CUDA IPC update is not bit-identical")
    # the first set warms up (first allocation of the engine's buffers)
    print(json.dumps({"receive": min(receive_s[1:]), "receive_and_load": min(load_s[1:])}))


def gpu_part(gb: float, repeat: int) -> dict[str, object]:
    """CUDA IPC update of the same tensors into a torch engine (another process, same GPU)
    against one device-to-device copy of the same bytes in one process. Goal: within 2x."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    from kuberl.common.weights import ManifestBuilder
    from kuberl.common.weights.publisher import GpuBuckets
    from kuberl.common.weights.transports.cuda_ipc import export_cuda_ipc

    tensors = {n: t.to("cuda") for n, t in make_tensors(gb, 1).items()}
    builder, buckets = ManifestBuilder(BUCKET_BYTES), GpuBuckets("cuda", BUCKET_BYTES)
    for name, tensor in tensors.items():
        buckets.add(builder.add(name, tensor.dtype, tensor.shape), tensor)
    manifest = builder.build()
    flat_buckets = buckets.finish(manifest.bucket_sizes)
    src = torch.cat(flat_buckets)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    copy_s = min(times[1:])
    handles = export_cuda_ipc(flat_buckets, sets=repeat + 1)
    out = subprocess.run(
        [sys.executable, __file__, "--gpu-engine", str(gb), str(repeat)],
        input=handles + "\n", capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    engine = json.loads(out.stdout.strip().splitlines()[-1])
    del flat_buckets
    return gpu_summary(
        torch.cuda.get_device_name(),
        manifest.total_bytes,
        copy_s,
        engine["receive"],
        engine["receive_and_load"],
    )


def gpu_summary(
    device: str, nbytes: int, copy_s: float, receive_s: float, receive_and_load_s: float
) -> dict[str, object]:
    """The GPU part's figures (benchmarks/report.py reads `cuda_ipc_update_seconds`: the update
    that the goal compares with one device-to-device copy of the same bytes)."""
    return {
        "device": device,
        "bytes": nbytes,
        "d2d_copy_seconds": copy_s,
        "cuda_ipc_update_seconds": receive_s,
        "cuda_ipc_receive_and_load_into_params_seconds": receive_and_load_s,
        "ratio_vs_d2d_copy": receive_s / copy_s,
        "ratio_with_load_vs_d2d_copy": receive_and_load_s / copy_s,
        "goal_2x_met": receive_s / copy_s <= 2.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gb", type=float, default=1.0, help="payload size in GB (1.0 ~ 0.5B bf16)"
    )
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--transports",
        nargs="+",
        default=["gloo", "shm", "shm_in_place"],
        help="gloo, shm (engines copy into their own double buffer), shm_in_place (engines "
        "serve from the shared read-only mapping, no copy)",
    )
    parser.add_argument("--repeat", type=int, default=2, help="timed versions per setting (best)")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="also run the CUDA IPC part (reports skipped without CUDA)",
    )
    parser.add_argument("--engine", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--gpu-engine", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--raw-rank", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        return _engine(*args.engine)
    if args.gpu_engine:
        return _gpu_engine(float(args.gpu_engine[0]), int(args.gpu_engine[1]))
    if args.raw_rank:
        rank, port, nbytes, out = args.raw_rank
        return _raw_pair(int(rank), int(port), int(nbytes), out)

    nbytes = sum(torch.Size(s).numel() * 2 for _, s in qwen05b_shapes(args.gb))
    load_before = os.getloadavg()
    raw = raw_pair_seconds(nbytes)
    runs: dict[str, dict[str, dict[str, float]]] = {}
    for transport in args.transports:
        for n in args.engines:
            r = relay_run(args.gb, transport, n, args.repeat)
            r["gb_per_second"] = r["bytes"] / r["seconds"] / GB
            r["ratio_vs_raw_pair"] = r["seconds"] / raw
            runs.setdefault(transport, {})[str(n)] = r
            print(f"{transport} engines={n}: {json.dumps(r)}", file=sys.stderr)
    four = {t: v["4"]["ratio_vs_raw_pair"] for t, v in runs.items() if "4" in v}
    result = {
        "benchmark": "weight_sync",
        "machine": f"{platform.node()} {os.cpu_count()} CPU cores, {platform.machine()}, "
        f"torch {torch.__version__}",
        "load_average_1_5_15": {"start": load_before, "end": os.getloadavg()},
        "payload_bytes": nbytes,
        "payload_gb": nbytes / GB,
        "baseline_raw_gloo_broadcast_pair": {"seconds": raw, "gb_per_second": nbytes / raw / GB},
        "relay": runs,
        "goal": "4-engine sync within 1.5x of the raw pair",
        "goal_met": {t: r <= 1.5 for t, r in four.items()},
        "gpu": gpu_part(args.gb, args.repeat) if args.gpu else {"skipped": "run with --gpu"},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
