"""The weight-sync service for real: `kuberl serve weight_sync` in a subprocess, engines and the
trainer as their own OS processes using `kuberl.common.weights`, tensors compared bit for bit.

This module is also the engines' and trainer's program (`python -m tests.integration.
test_weight_sync engine|trainer ...`), so what runs in them is visible next to the assertions.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
from kuberl.common.channels import sync_channel
from kuberl.common.weights import EngineClient, VersionConflict, WeightPublisher, plan
from kuberl.common.weights.chunks import iter_chunks
from tests.support import REPO, ServiceProcess, scratch_shm_dir

MB = 1024 * 1024


def make_tensors(seed: int, total_mb: float = 4.0) -> dict[str, torch.Tensor]:
    """A deterministic mix of bf16 matrices, fp32 vectors and an odd-sized int8 tensor."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    per_layer = 512 * 1024  # elements of one bf16 matrix: 1 MiB
    for i in range(max(1, int(total_mb))):
        out[f"layers.{i}.mlp.weight"] = torch.randn(512, 1024, generator=g).to(torch.bfloat16)
        out[f"layers.{i}.norm.weight"] = torch.randn(1000, generator=g)
    out["lm_head.scale"] = torch.randint(-100, 100, (7,), generator=g, dtype=torch.int8)
    assert out["layers.0.mlp.weight"].numel() == per_layer
    return out


# ---------------------------------------------------------------- the processes' programs


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes, in order."""
    h = hashlib.sha256()
    for v in tensors.values():
        h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _engine_main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if args.die_after_buckets or args.stall_after_buckets:
        # Test hooks, in the middle of a broadcast, after N buckets arrived: SIGKILL this engine
        # (dead), or stall its receive until the test creates `<name>.release` (alive and slow:
        # the heartbeat thread goes on). It says it stalled with `<name>.stalled`. Once only.
        from kuberl.common.weights.transports import broadcast as collective

        real, received = collective.broadcast, [0]

        def hooked_broadcast(group, tensor, timeout_s, backend="gloo"):  # type: ignore[no-untyped-def]
            real(group, tensor, timeout_s, backend)
            received[0] += 1
            if received[0] == args.die_after_buckets:
                os.kill(os.getpid(), signal.SIGKILL)
            if received[0] == args.stall_after_buckets:
                (out / f"{args.name}.stalled").touch()
                while not (out / f"{args.name}.release").exists():
                    time.sleep(0.02)

        collective.broadcast = hooked_broadcast  # what BroadcastReceiver calls per bucket
    holder: dict[str, Any] = {}

    def load(tensors: dict[str, torch.Tensor], version: int) -> None:
        (out / f"{args.name}.loading-v{version}").touch()
        save_file(
            {k: v.cpu().contiguous() for k, v in tensors.items()},
            out / f"{args.name}-v{version}.st",
        )
        line = {"version": version, "transport": holder["client"].current_transport}
        time.sleep(args.load_seconds)  # a slow engine: later versions are published meanwhile
        if args.shm_in_place:  # the version held until now must not have changed under us
            held = holder.get("held")
            line["held_intact"] = held is None or _digest(held[0]) == held[1]
            holder["held"] = (tensors, _digest(tensors))
            line["digest"] = holder["held"][1]  # what it serves from once loaded
        with (out / f"{args.name}.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")

    client = EngineClient(
        args.address, load=load, engine_id=args.name, transports=args.transports,
        device=args.device, gpu=args.gpu, shm_in_place=args.shm_in_place,
    )  # fmt: skip
    holder["client"] = client
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # Test hook: up (torch imported) but registering only when the test creates `<name>.register`.
    while args.register_on_cue and not (out / f"{args.name}.register").exists():
        if stop.wait(0.02):
            return
    client.start()
    stop.wait()
    client.stop()


def _trainer_main(args: argparse.Namespace) -> None:
    tensors = {k: v.to(args.device) for k, v in make_tensors(args.seed, args.mb).items()}
    with WeightPublisher(args.address, transports=args.transports, device=args.device) as pub:
        result = pub.publish(args.version, iter(tensors.items()))
        print(
            json.dumps(
                {
                    "version": result.version,
                    "transport": result.transport,
                    "cuda_ipc_sets": result.cuda_ipc_sets,
                }
            ),
            flush=True,
        )
        # CUDA IPC: the engines copy from this process's GPU memory, so stay until they did.
        with sync_channel(args.address) as channel:
            stub = pb_grpc.WeightSyncServiceStub(channel)
            deadline = time.monotonic() + 60
            while args.hold_until_loaded and time.monotonic() < deadline:
                engines = stub.GetStatus(pb.GetStatusRequest(), timeout=5).engines
                if engines and min(e.loaded_version for e in engines) >= args.version:
                    break
                time.sleep(0.1)


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """One relay for the module (tests publish versions above whatever is current)."""
    yield from _service(tmp_path_factory.mktemp("weight-sync"), ["gloo", "snapshot"])


def _next_version(svc: ServiceProcess) -> int:
    with sync_channel(svc.address) as channel:
        stub = pb_grpc.WeightSyncServiceStub(channel)
        return int(stub.GetVersion(pb.GetVersionRequest(), timeout=5).version) + 1


def _service(
    tmp_path: Path,
    transports: list[str],
    device: str = "cpu",
    retain: int = 2,
    broadcast_timeout: float = 20,
) -> Iterator[ServiceProcess]:
    config = _job_file(tmp_path, transports, device, retain, broadcast_timeout)
    with ServiceProcess.kuberl("weight_sync", config, tmp_path) as proc:
        proc.wait_serving()
        yield proc


def _job_file(
    tmp_path: Path,
    transports: list[str],
    device: str = "cpu",
    retain: int = 2,
    broadcast_timeout: float = 20,
) -> Path:
    shm_dir = scratch_shm_dir("kuberl-test")
    config = tmp_path / "job.yaml"
    config.write_text(
        json.dumps(
            {
                "job": {"name": "wstest"},
                "weight_sync": {
                    "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
                    "transports": transports,
                    "device": device,
                    "retain_versions": retain,
                    "bucket_bytes": MB,
                    "heartbeat_seconds": 0.5,
                    "missed_heartbeats": 3,
                    "broadcast_timeout_seconds": broadcast_timeout,
                    "shm_dir": shm_dir,
                    "advertise_host": "127.0.0.1",
                    "notify_engines": False,
                },
            }
        )
    )
    return config


def _start(role: str, tmp_path: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    log = (tmp_path / f"{name}.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.test_weight_sync", role, *args],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _engine(svc: ServiceProcess, tmp_path: Path, name: str, *extra: str) -> subprocess.Popen[bytes]:
    return _start("engine", tmp_path, name, svc.address, str(tmp_path), name, *extra)


def _publish(
    svc: ServiceProcess, tmp_path: Path, version: int, seed: int, mb: float = 4, *extra: str
) -> dict:
    proc = _start(
        "trainer", tmp_path, f"trainer-v{version}", svc.address, str(version), str(seed), str(mb),
        *extra,
    )  # fmt: skip
    code = proc.wait(90)
    text = (tmp_path / f"trainer-v{version}.log").read_text()
    assert code == 0, text
    return json.loads(next(x for x in reversed(text.splitlines()) if x.startswith('{"version"')))


def _status(svc: ServiceProcess) -> pb.GetStatusResponse:
    with sync_channel(svc.address) as channel:
        return pb_grpc.WeightSyncServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=5)


def _wait(condition, what: str, svc: ServiceProcess, timeout: float = 45.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; status: {_status(svc)}\n{svc.log()}")


def _holding(svc: ServiceProcess, version: int) -> set[str]:
    return {e.engine_id for e in _status(svc).engines if e.loaded_version >= version}


def _registered(svc: ServiceProcess) -> set[str]:
    return {e.engine_id for e in _status(svc).engines}


def _lines(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    """What the test engine `name` recorded of each version it loaded."""
    path = tmp_path / f"{name}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _history(tmp_path: Path, name: str) -> list[tuple[int, str]]:
    return [(x["version"], x["transport"]) for x in _lines(tmp_path, name)]


def _stall_through(
    svc: ServiceProcess, engine: subprocess.Popen[bytes], pub: WeightPublisher, seeds: dict
) -> None:
    """Stop `engine` (SIGSTOP) until the service drops it, publish `seeds` (version -> seed of
    `make_tensors`) meanwhile, then let it go on."""
    engine.send_signal(signal.SIGSTOP)
    _wait(lambda: not _registered(svc), "the silent engine dropped", svc)
    for version, seed in seeds.items():
        pub.publish(version, iter(make_tensors(seed).items()))
    engine.send_signal(signal.SIGCONT)


def _bit_identical(tmp_path: Path, name: str, version: int, seed: int, mb: float = 4) -> bool:
    got = load_file(str(tmp_path / f"{name}-v{version}.st"))
    want = make_tensors(seed, mb)
    return got.keys() == want.keys() and all(
        got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8))
        for k, v in want.items()
    )


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()


def _metric(svc: ServiceProcess, line_start: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _engines_behind(svc: ServiceProcess) -> dict[str, float]:
    """The `engines_behind` gauge, every series of it, by its `behind` label."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics").read().decode()
    prefix = 'kuberl_weight_sync_engines_behind{behind="'
    return {
        line[len(prefix) :].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


# ---------------------------------------------------------------- tests


def test_gloo_broadcast_from_a_trainer_process_to_three_engines_is_bit_identical(
    service: ServiceProcess, tmp_path: Path
) -> None:
    names = ["e0", "e1", "e2"]
    engines = [_engine(service, tmp_path, n) for n in names]
    gloo_out = 'kuberl_weight_sync_bytes_total{direction="out",transport="gloo"}'
    nbytes = plan([(k, t.dtype, t.shape) for k, t in make_tensors(11).items()], MB).total_bytes
    try:
        _wait(lambda: len(_status(service).engines) == 3, "3 engines registered", service)
        v = _next_version(service)
        out_before = _metric(service, gloo_out)
        sent = _publish(service, tmp_path, version=v, seed=11)
        _wait(lambda: _holding(service, v) >= set(names), "all engines at v", service)
        results = {n: (_history(tmp_path, n), _bit_identical(tmp_path, n, v, 11)) for n in names}
        # The relay's three senders count their bytes when each broadcast returns.
        _wait(
            lambda: _metric(service, gloo_out) - out_before >= 3 * nbytes,
            "3 sends counted",
            service,
        )
        counted = _metric(service, gloo_out) - out_before
        bandwidth = _metric(
            service,
            'kuberl_weight_sync_bandwidth_bytes_per_second{direction="out",transport="gloo"}',
        )
    finally:
        _stop(*engines)
    assert sent["transport"] == "snapshot"  # trainer -> relay upload; relay -> engines by gloo
    assert results == {n: ([(v, "gloo")], True) for n in names}
    assert (counted, bandwidth > 0) == (3 * nbytes, True)


def test_an_engine_joining_mid_job_gets_the_current_version_by_snapshot_then_the_next_by_broadcast(
    service: ServiceProcess, tmp_path: Path
) -> None:
    first = _engine(service, tmp_path, "early")
    late = None
    try:
        _wait(lambda: "early" in _registered(service), "first engine registered", service)
        v = _next_version(service)
        _publish(service, tmp_path, version=v, seed=1)
        _wait(lambda: "early" in _holding(service, v), "early engine at v", service)
        late = _engine(service, tmp_path, "late")
        _wait(lambda: "late" in _holding(service, v), "late engine caught up to v", service)
        _publish(service, tmp_path, version=v + 1, seed=2)
        _wait(lambda: _holding(service, v + 1) >= {"early", "late"}, "both at v+1", service)
        history = _history(tmp_path, "late")
        identical = _bit_identical(tmp_path, "late", v, 1)
        identical &= _bit_identical(tmp_path, "late", v + 1, 2)
    finally:
        _stop(first, *([late] if late else []))
    assert (history, identical) == ([(v, "snapshot"), (v + 1, "gloo")], True)


def test_an_engine_sigkilled_during_a_broadcast_is_dropped_and_the_others_finish(
    service: ServiceProcess, tmp_path: Path
) -> None:
    engines = [_engine(service, tmp_path, n) for n in ("ok0", "ok1")]
    engines.append(_engine(service, tmp_path, "doomed", "--die-after-buckets", "2"))
    try:
        names = {"ok0", "ok1", "doomed"}
        _wait(lambda: _registered(service) >= names, "3 engines registered", service)
        dropped_before = _metric(service, 'kuberl_weight_sync_timeouts_total{kind="heartbeat"}')
        v = _next_version(service)
        _publish(service, tmp_path, version=v, seed=5, mb=8)  # 9 buckets of 1 MiB
        _wait(lambda: _holding(service, v) >= {"ok0", "ok1"}, "survivors at v", service)
        _wait(lambda: "doomed" not in _registered(service), "the killed engine dropped", service)
        killed = engines[2].wait(5)
        identical = all(_bit_identical(tmp_path, n, v, 5, mb=8) for n in ("ok0", "ok1"))
        dropped = _metric(service, 'kuberl_weight_sync_timeouts_total{kind="heartbeat"}')
        dropped -= dropped_before
    finally:
        _stop(*engines)
    assert (killed, identical, dropped) == (-signal.SIGKILL, True, 1.0)


def test_an_engine_stalled_in_a_broadcast_times_out_alone_and_catches_up_by_snapshot(
    tmp_path: Path,
) -> None:
    # "slow" stalls, alive and heartbeating, after the first bucket of its first broadcast, and
    # is released only once its update timed out (deadline 4 s), the trainer published v2 and
    # both other engines hold v2.
    timeouts = 'kuberl_weight_sync_timeouts_total{kind="update"}'
    beats = 'kuberl_weight_sync_rpc_requests_total{code="OK",method="Heartbeat"}'
    for svc in _service(tmp_path, ["gloo", "snapshot"], broadcast_timeout=4):
        names = ["fast0", "fast1", "slow"]
        engines = [_engine(svc, tmp_path, n) for n in names[:2]]
        engines.append(_engine(svc, tmp_path, "slow", "--stall-after-buckets", "1"))
        try:
            _wait(lambda: _registered(svc) == set(names), "3 engines registered", svc)  # noqa: B023
            with WeightPublisher(svc.address) as pub:
                pub.publish(1, iter(make_tensors(31).items()))
                timeouts_when_back = _metric(svc, timeouts)  # the trainer is back
                _wait((tmp_path / "slow.stalled").exists, "the slow engine stalled", svc)
                stalled_at, beats_before = time.monotonic(), _metric(svc, beats)
                _wait(lambda: _metric(svc, timeouts) >= 1, "the update timed out", svc)  # noqa: B023
                pub.publish(2, iter(make_tensors(32).items()))
            _wait(lambda: _holding(svc, 2) >= {"fast0", "fast1"}, "fast ones at v2", svc)  # noqa: B023
            meanwhile = sorted((e.engine_id, e.loaded_version) for e in _status(svc).engines)
            gauge_meanwhile = _engines_behind(svc)
            beats_per_second = (_metric(svc, beats) - beats_before) / (
                time.monotonic() - stalled_at
            )
            (tmp_path / "slow.release").touch()
            _wait(lambda: "slow" in _holding(svc, 2), "the slow engine caught up to v2", svc)  # noqa: B023
            gauge_after = _engines_behind(svc)
            histories = {n: _history(tmp_path, n) for n in names}
            identical = all(_bit_identical(tmp_path, n, 2, 32) for n in names)
            identical &= all(_bit_identical(tmp_path, n, 1, 31) for n in names[:2])
            counted = {
                "update": _metric(svc, timeouts),
                "heartbeat": _metric(svc, 'kuberl_weight_sync_timeouts_total{kind="heartbeat"}'),
                "gloo failures": _metric(
                    svc, 'kuberl_weight_sync_engine_update_failures_total{transport="gloo"}'
                ),
            }
        finally:
            _stop(*engines)
        # The trainer was back before the deadline; the others went on to v2 while the slow one,
        # still registered, held nothing; it then got v2 by snapshot. One timeout, counted once
        # (not also as a failure, whichever of the reaper and the relay's gloo timeout saw it).
        assert timeouts_when_back == 0
        assert meanwhile == [("fast0", 2), ("fast1", 2), ("slow", 0)]
        # The same five series throughout, whatever the versions.
        assert gauge_meanwhile == {"ahead": 0, "0": 2, "1": 0, "2": 1, "3+": 0}
        assert gauge_after == {"ahead": 0, "0": 3, "1": 0, "2": 0, "3+": 0}
        assert histories == {
            "fast0": [(1, "gloo"), (2, "gloo")], "fast1": [(1, "gloo"), (2, "gloo")],
            "slow": [(2, "snapshot")],
        }  # fmt: skip
        assert identical
        assert counted == {"update": 1.0, "heartbeat": 0.0, "gloo failures": 0.0}
        # Long polls: ~2 a second per engine with heartbeat_seconds 0.5 (thousands when the
        # slow engine's client asked again at once while its update was assigned).
        assert beats_per_second < 30


def test_an_engine_registering_during_a_broadcast_gets_that_version_by_snapshot_then_the_next(
    service: ServiceProcess, tmp_path: Path
) -> None:
    # "streaming" stalls after the first bucket of version v: v's broadcast is under way when
    # "joiner" (already started, waiting for its cue) registers.
    streaming = _engine(service, tmp_path, "streaming", "--stall-after-buckets", "1")
    joiner = _engine(service, tmp_path, "joiner", "--register-on-cue")
    try:
        _wait(lambda: "streaming" in _registered(service), "streaming registered", service)
        v = _next_version(service)
        # The shared service may hold an earlier test's version, which "streaming" catches up to
        # by snapshot when it registers: let that finish, so that v surely goes by broadcast.
        _wait(lambda: "streaming" in _holding(service, v - 1), "streaming caught up", service)
        with WeightPublisher(service.address) as pub:
            pub.publish(v, iter(make_tensors(41).items()))
            _wait((tmp_path / "streaming.stalled").exists, "v's broadcast under way", service)
            (tmp_path / "joiner.register").touch()
            _wait(lambda: "joiner" in _holding(service, v), "the joiner at v", service)
            streaming_during = "streaming" in _holding(service, v)
            (tmp_path / "streaming.release").touch()
            _wait(lambda: "streaming" in _holding(service, v), "streaming at v", service)
            pub.publish(v + 1, iter(make_tensors(42).items()))
        _wait(lambda: _holding(service, v + 1) >= {"streaming", "joiner"}, "both at v+1", service)
        histories = {  # from v on (before v: the catch-up to an earlier test's version)
            n: [h for h in _history(tmp_path, n) if h[0] >= v] for n in ("streaming", "joiner")
        }
        identical = all(
            _bit_identical(tmp_path, n, version, seed)
            for n in histories
            for version, seed in ((v, 41), (v + 1, 42))
        )
    finally:
        _stop(streaming, joiner)
    assert streaming_during is False  # the joiner got v while v's broadcast was still running
    assert histories == {
        "streaming": [(v, "gloo"), (v + 1, "gloo")], "joiner": [(v, "snapshot"), (v + 1, "gloo")],
    }  # fmt: skip
    assert identical


def test_versions_stay_monotonic_under_concurrent_publishes(
    service: ServiceProcess, tmp_path: Path
) -> None:
    tensors = {"w": torch.arange(64, dtype=torch.float32)}
    outcomes: list[tuple[int, str]] = []
    seen: list[int] = []
    done = threading.Event()

    base = _next_version(service)

    def publisher(start: int) -> None:
        with WeightPublisher(service.address) as pub:
            for version in range(base + start, base + 24, 4):
                try:
                    pub.publish(version, iter(tensors.items()))
                    outcomes.append((version, "ok"))
                except VersionConflict:
                    outcomes.append((version, "conflict"))

    def watcher() -> None:
        with WeightPublisher(service.address) as pub:
            while not done.is_set():
                seen.append(pub.current_version())
                time.sleep(0.01)

    # An engine in the pool meanwhile: what it loads must only go up, ending at the last version.
    loaded: list[int] = []
    engine = EngineClient(
        service.address, load=lambda tensors, v: loaded.append(v), engine_id="concurrent",
        transports=["snapshot"],
    )  # fmt: skip
    engine.start()
    threads = [threading.Thread(target=publisher, args=(s,)) for s in (0, 1, 2, 3)]
    watch = threading.Thread(target=watcher)
    watch.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    done.set()
    watch.join(10)
    with WeightPublisher(service.address) as pub:
        final = pub.current_version()
    engine.wait_for_version(final, timeout=30)
    engine.stop()
    accepted = [v for v, r in outcomes if r == "ok"]
    assert len(outcomes) == 24 and accepted
    assert seen == sorted(seen) and final == max(accepted)
    assert loaded == sorted(set(loaded)) and loaded[-1] == final


def test_a_later_announcement_supersedes_a_pending_one_and_its_bytes_never_commit(
    service: ServiceProcess,
) -> None:
    # The deterministic half of monotonic versions: v+1's upload is under way (its first chunk
    # sent: checked at commit, or at that chunk if it arrives late) when v is announced (above
    # the committed version: it replaces v+1's announcement) and then a later trainer announces
    # and commits v+2; v+1's last bytes then arrive.
    v = _next_version(service)
    go = threading.Event()
    codes: dict[str, grpc.StatusCode] = {}
    reasons = ("stale_version", "not_announced", "superseded")

    def rejected() -> list[float]:
        metric = "kuberl_weight_sync_rejected_total"
        return [_metric(service, f'{metric}{{reason="{r}"}}') for r in reasons]

    rejected_before = rejected()

    def slow_upload(chunks: list[pb.SnapshotChunk]) -> Iterator[pb.SnapshotChunk]:
        yield chunks[0]
        go.wait(30)
        yield from chunks[1:]

    with sync_channel(service.address) as channel:
        stub = pb_grpc.WeightSyncServiceStub(channel)

        def call(name: str, fn, *args) -> None:  # type: ignore[no-untyped-def]
            try:
                fn(*args, timeout=30)
                codes[name] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                codes[name] = exc.code()

        def publish(version: int) -> pb.PublishRequest:
            return pb.PublishRequest(version=version, transports=[pb.TRANSPORT_SNAPSHOT])

        call("announce v+1", stub.Publish, publish(v + 1))
        late = threading.Thread(
            target=call, args=("upload v+1", stub.UploadSnapshot, slow_upload(_chunks(v + 1)))
        )
        late.start()
        time.sleep(0.3)  # its first chunk reaches the service
        call("announce v", stub.Publish, publish(v))
        call("announce v+2", stub.Publish, publish(v + 2))
        call("upload v+2", stub.UploadSnapshot, iter(_chunks(v + 2)))
        go.set()
        late.join(30)
        call("announce v+2 again", stub.Publish, publish(v + 2))
        current = stub.GetVersion(pb.GetVersionRequest(), timeout=5).version
    stale, unannounced, superseded = (
        a - b for a, b in zip(rejected(), rejected_before, strict=True)
    )
    refused, ok = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OK
    assert codes == {
        "announce v+1": ok, "announce v": ok, "announce v+2": ok, "upload v+2": ok,
        "upload v+1": refused, "announce v+2 again": refused,
    }  # fmt: skip
    assert current == v + 2
    # Every refusal counted: one stale announcement (v+2 again, once committed), and v+1's
    # bytes (refused at their first chunk if it came after another announcement, else at commit).
    assert (stale, unannounced + superseded) == (1, 1)


def test_a_service_sigkilled_and_restarted_keeps_its_version_and_hands_it_to_a_new_engine(
    tmp_path: Path,
) -> None:
    config = _job_file(tmp_path, ["shm", "snapshot"])
    shm_dir = json.loads(config.read_text())["weight_sync"]["shm_dir"]
    first = ServiceProcess.kuberl("weight_sync", config, tmp_path, name="ws-first")
    try:
        first.wait_serving()
        with WeightPublisher(first.address) as pub:  # shm: the service hashes it to seal it
            pub.publish(7, iter(make_tensors(7).items()))
        _wait(lambda: "event=store.sealed version=7" in first.log(), "v7 sealed", first)
        first.signal(signal.SIGKILL)
        first.proc.wait(15)
    finally:
        first.stop()
    second = ServiceProcess.kuberl("weight_sync", config, tmp_path, name="ws-second")
    engine = None
    try:
        second.wait_serving()
        restored = _status(second).current_version
        refused = []
        with WeightPublisher(second.address) as pub:
            for stale in (6, 7):
                try:
                    pub.publish(stale, iter(make_tensors(stale).items()))
                except VersionConflict:
                    refused.append(stale)
            engine = _engine(second, tmp_path, "late")
            _wait(lambda: "late" in _holding(second, 7), "engine at v7", second)
            identical = _bit_identical(tmp_path, "late", 7, 7)
            pub.publish(8, iter(make_tensors(8).items()))
        _wait(lambda: "late" in _holding(second, 8), "engine at v8", second)
        history = _history(tmp_path, "late")
    finally:
        if engine is not None:
            _stop(engine)
        second.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
    assert (restored, refused, identical) == (7, [6, 7], True)
    assert history == [(7, "snapshot"), (8, "shm")]


def _tensors_alive_while_publishing(address: str, version: int) -> list[int]:
    """Publish 8 tensors of 1 MiB from a generator; at each of its steps, how many tensors it
    yielded two or more steps earlier are still alive (held by the publisher)."""
    refs: list[weakref.ref[torch.Tensor]] = []
    alive: list[int] = []

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(8):
            gc.collect()
            alive.append(sum(r() is not None for r in refs[:-1]))
            tensor = torch.full((256 * 1024,), float(i))
            refs.append(weakref.ref(tensor))
            yield f"w{i}", tensor
            del tensor

    with WeightPublisher(address) as pub:
        pub.publish(version, tensors())
    return alive


def test_the_trainer_client_sends_each_tensor_before_it_takes_the_next(
    service: ServiceProcess, tmp_path: Path
) -> None:
    # A trainer feeds ZeRO-3-gathered parameters one bucket at a time: the publisher must let go
    # of each before asking for more, over the gRPC upload and over shared memory alike.
    uploaded = _tensors_alive_while_publishing(service.address, _next_version(service))
    for svc in _service(tmp_path, ["shm", "snapshot"]):
        shm = _tensors_alive_while_publishing(svc.address, 1)
        sent = "event=publish.committed version=1 transport=shm" in svc.log()
    assert (uploaded, shm, sent) == ([0] * 8, [0] * 8, True)


def _upload(channel: grpc.Channel, version: int, chunks: list[pb.SnapshotChunk]) -> None:
    stub = pb_grpc.WeightSyncServiceStub(channel)
    stub.Publish(pb.PublishRequest(version=version, transports=[pb.TRANSPORT_SNAPSHOT]), timeout=5)
    stub.UploadSnapshot(iter(chunks), timeout=10)


def _chunks(version: int) -> list[pb.SnapshotChunk]:
    payload = bytes(range(256)) * 4096  # 1 MiB
    manifest = plan([("w", torch.uint8, (len(payload),))], bucket_bytes=MB)
    return list(iter_chunks(version, [payload], chunk_bytes=64 * 1024, manifest_first=manifest))


def _damaged(version: int, damage: str) -> list[pb.SnapshotChunk]:
    chunks = _chunks(version)
    if damage == "flipped byte":
        data = bytearray(chunks[5].data)
        data[100] ^= 0xFF
        chunks[5].data = bytes(data)
    elif damage == "truncated":
        chunks = chunks[:-1]
    else:  # a chunk missing in the middle
        del chunks[3]
    return chunks


def test_corrupt_truncated_or_gapped_snapshot_uploads_are_rejected_and_can_be_sent_again(
    service: ServiceProcess,
) -> None:
    metric = 'kuberl_weight_sync_rejected_total{reason="corrupt_snapshot"}'
    rejected_before = _metric(service, metric)
    codes, versions = [], []
    before = _next_version(service) - 1
    with sync_channel(service.address) as channel:
        stub = pb_grpc.WeightSyncServiceStub(channel)
        for v, damage in enumerate(("flipped byte", "truncated", "missing chunk"), before + 1):
            with pytest.raises(grpc.RpcError) as err:
                _upload(channel, v, _damaged(v, damage))
            codes.append(err.value.code())
            versions.append(stub.GetVersion(pb.GetVersionRequest()).version)
        # The service keeps working, and a refused version was never adopted: the trainer's
        # retry of it (intact this time) is accepted, not refused as stale.
        _upload(channel, before + 3, _chunks(before + 3))
        latest = stub.GetVersion(pb.GetVersionRequest()).version
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert (versions, latest) == ([before] * 3, before + 3)
    assert _metric(service, metric) - rejected_before == 3


def test_a_trainer_and_engine_on_the_services_host_move_weights_through_shared_memory(
    tmp_path: Path,
) -> None:
    for svc in _service(tmp_path, ["shm", "gloo", "snapshot"]):
        engine = _engine(svc, tmp_path, "local")
        try:
            _wait(lambda: len(_status(svc).engines) == 1, "engine registered", svc)  # noqa: B023
            sent = _publish(svc, tmp_path, version=3, seed=3)
            _wait(lambda: "local" in _holding(svc, 3), "engine at v3", svc)  # noqa: B023
            history = _history(tmp_path, "local")
            identical = _bit_identical(tmp_path, "local", 3, 3)
        finally:
            _stop(engine)
        assert (sent["transport"], history, identical) == ("shm", [(3, "shm")], True)


def test_an_engine_serving_from_shared_memory_in_place_keeps_its_version_unchanged_until_the_next(
    tmp_path: Path,
) -> None:
    # The relay keeps one version. The engine takes 3 s to load v2 while still serving v1 from
    # its file; v3 is published meanwhile and must not be written into v1's file.
    for svc in _service(tmp_path, ["shm", "snapshot"], retain=1):
        engine = _engine(svc, tmp_path, "inplace", "--shm-in-place", "--load-seconds", "3")
        try:
            _wait(lambda: len(_status(svc).engines) == 1, "engine registered", svc)  # noqa: B023
            with WeightPublisher(svc.address) as pub:  # in this process: v3 lands in time
                pub.publish(1, iter(make_tensors(21).items()))
                _wait(lambda: "inplace" in _holding(svc, 1), "engine at v1", svc)  # noqa: B023
                pub.publish(2, iter(make_tensors(22).items()))
                loading = tmp_path / "inplace.loading-v2"
                _wait(loading.exists, "the engine loading v2", svc)
                pub.publish(3, iter(make_tensors(23).items()))
            _wait(lambda: "inplace" in _holding(svc, 3), "engine at v3", svc)  # noqa: B023
            lines = _lines(tmp_path, "inplace")
            identical = all(_bit_identical(tmp_path, "inplace", v, 20 + v) for v in (1, 2, 3))
        finally:
            _stop(engine)
        # v3 reached the engine while it was busy with v2: by snapshot, into its own buffer.
        assert [(x["version"], x["transport"], x["held_intact"]) for x in lines] == [
            (1, "shm", True), (2, "shm", True), (3, "snapshot", True),
        ]  # fmt: skip
        assert identical


def test_the_segment_a_dropped_in_place_engine_serves_from_is_never_rewritten(
    tmp_path: Path,
) -> None:
    # An engine serving v1 from its shared-memory file in place stalls (SIGSTOP) and is dropped
    # for silence. v2 and v3 are published meanwhile (the relay keeps one version), so v1's
    # segment is pruned: it must be deleted, not reused for v3 under the stalled engine. Back,
    # the engine registers again, takes v3 and finds v1 as it left it.
    for svc in _service(tmp_path, ["shm", "snapshot"], retain=1):
        engine = _engine(svc, tmp_path, "stalled", "--shm-in-place")
        try:
            _wait(lambda: len(_status(svc).engines) == 1, "engine registered", svc)  # noqa: B023
            with WeightPublisher(svc.address) as pub:
                pub.publish(1, iter(make_tensors(31).items()))
                _wait(lambda: "stalled" in _holding(svc, 1), "engine at v1", svc)  # noqa: B023
                _stall_through(svc, engine, pub, {2: 32, 3: 33})
            _wait(lambda: "stalled" in _holding(svc, 3), "engine back at v3", svc)  # noqa: B023
            lines = _lines(tmp_path, "stalled")
            identical = all(_bit_identical(tmp_path, "stalled", v, 30 + v) for v in (1, 3))
        finally:
            engine.send_signal(signal.SIGCONT)
            _stop(engine)
        assert [(x["version"], x["held_intact"]) for x in lines] == [(1, True), (3, True)]
        assert identical


def test_the_segment_a_dropped_in_place_engine_is_loading_from_is_never_rewritten(
    tmp_path: Path,
) -> None:
    # As above, but the engine stalls in the middle of loading v2 in place (it took the views
    # of v2's segment and is still in `load`): that segment must not be reused either.
    for svc in _service(tmp_path, ["shm", "snapshot"], retain=1):
        engine = _engine(svc, tmp_path, "loading", "--shm-in-place", "--load-seconds", "2")
        try:
            _wait(lambda: len(_status(svc).engines) == 1, "engine registered", svc)  # noqa: B023
            with WeightPublisher(svc.address) as pub:
                pub.publish(1, iter(make_tensors(51).items()))
                _wait(lambda: "loading" in _holding(svc, 1), "engine at v1", svc)  # noqa: B023
                pub.publish(2, iter(make_tensors(52).items()))
                _wait((tmp_path / "loading.loading-v2").exists, "the engine loading v2", svc)
                _stall_through(svc, engine, pub, {3: 53, 4: 54})
            _wait(lambda: "loading" in _holding(svc, 4), "engine back at v4", svc)  # noqa: B023
            lines = _lines(tmp_path, "loading")
        finally:
            engine.send_signal(signal.SIGCONT)
            _stop(engine)
        # v2's views were still v2 at the end of its load, after the stall.
        v2 = next(x for x in lines if x["version"] == 2)
        assert v2["digest"] == _digest(make_tensors(52))
        assert all(x["held_intact"] for x in lines), lines


def _fake_cuda_ipc_export(gpu: str, bucket_sizes: list[int]) -> str:
    """Well-formed CUDA IPC handles (JSON) pointing at nothing: this machine has no GPU, so the
    engine's open fails, which is the path under test (routing, the wire form, the fallback)."""
    bucket = {
        "stride": [1], "offset": 0, "dtype": "uint8", "handle": "A" * 86 + "==",
        "storage_offset": 0, "ref_handle": "L3RvcmNo", "ref_offset": 0, "event_handle": "",
        "event_sync": False,
    }  # fmt: skip
    buckets = [{**bucket, "size": [n], "storage_bytes": n} for n in bucket_sizes]
    return json.dumps({"gpu_uuid": gpu, "sets": [{"buckets": buckets}]})


def _publish_with_cuda_ipc(stub, version: int, seed: int, gpu: str, handles_gpu: str):  # type: ignore[no-untyped-def]
    """The trainer's side of a CUDA IPC publish, step by step: Publish offering cuda_ipc from
    `gpu`, the bytes into shared memory, CommitPublish with handles said to be on `handles_gpu`."""
    from kuberl.common.weights import ManifestBuilder
    from kuberl.common.weights.transports.shm import ShmWriter

    answer = stub.Publish(
        pb.PublishRequest(
            version=version, transports=[pb.TRANSPORT_CUDA_IPC, pb.TRANSPORT_SHM],
            trainer_host=socket.gethostname(), gpu_uuid=gpu,
        ),
        timeout=10,
    )  # fmt: skip
    builder = ManifestBuilder(answer.send.manifest.bucket_bytes)
    writer = ShmWriter(json.loads(answer.send.handles_json)["path"])
    for name, tensor in make_tensors(seed).items():
        writer.write(builder.add(name, tensor.dtype, tensor.shape).flat_offset, tensor)
    manifest = builder.build()
    writer.close(manifest.total_bytes)
    stub.CommitPublish(
        pb.CommitPublishRequest(
            version=version, manifest=manifest.to_proto(),
            cuda_ipc_handles_json=_fake_cuda_ipc_export(handles_gpu, manifest.bucket_sizes),
        ),
        timeout=10,
    )  # fmt: skip
    return answer


def test_cuda_ipc_handles_go_only_to_the_engine_on_the_trainers_gpu_which_falls_back_to_snapshot(
    tmp_path: Path,
) -> None:
    for svc in _service(tmp_path, ["cuda_ipc", "shm", "snapshot"]):
        offer = ["--transports", "cuda_ipc", "shm", "snapshot"]
        engines = [
            _engine(svc, tmp_path, "same-gpu", *offer, "--gpu", "GPU-trainer"),
            _engine(svc, tmp_path, "other-gpu", *offer, "--gpu", "GPU-other"),
        ]
        try:
            _wait(lambda: len(_status(svc).engines) == 2, "2 engines registered", svc)  # noqa: B023
            failed = 'kuberl_weight_sync_engine_update_failures_total{transport="cuda_ipc"}'
            with sync_channel(svc.address) as channel:
                stub = pb_grpc.WeightSyncServiceStub(channel)
                answer = _publish_with_cuda_ipc(stub, 7, 7, "GPU-trainer", "GPU-trainer")
                _wait(lambda: len(_holding(svc, 7)) == 2, "both engines at v7", svc)  # noqa: B023
                with pytest.raises(grpc.RpcError) as refused:  # handles of another GPU
                    _publish_with_cuda_ipc(stub, 8, 8, "GPU-trainer", "GPU-other")
                current = stub.GetVersion(pb.GetVersionRequest(), timeout=5).version
            histories = {n: _history(tmp_path, n) for n in ("same-gpu", "other-gpu")}
            identical = all(_bit_identical(tmp_path, n, 7, 7) for n in histories)
            failures = _metric(svc, failed)
            rejected = _metric(
                svc, 'kuberl_weight_sync_rejected_total{reason="bad_cuda_ipc_handles"}'
            )
        finally:
            _stop(*engines)
        # The colocated engine was sent the handles; without CUDA it could not open them,
        # reported the failure and was caught up by snapshot. The other one never saw them.
        assert (answer.cuda_ipc_engines, failures, identical) == (1, 1.0, True)
        assert histories == {"same-gpu": [(7, "snapshot")], "other-gpu": [(7, "shm")]}
        assert (refused.value.code(), current, rejected) == (
            grpc.StatusCode.INVALID_ARGUMENT, 7, 1.0,
        )  # fmt: skip


class _FakeGpuBuckets:
    """Stands in for the publisher's GPU buckets (no GPU here): keeps nothing, hands back the
    bucket sizes for `_fake_cuda_ipc_export` to describe."""

    def __init__(self, device: str, bucket_bytes: int) -> None:
        pass

    def add(self, entry: Any, tensor: torch.Tensor) -> None:
        pass

    def finish(self, bucket_sizes: list[int]) -> list[int]:
        return list(bucket_sizes)


def test_a_publisher_whose_cuda_ipc_handles_are_refused_publishes_the_retry_without_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The publisher's CUDA side is faked (no GPU here): its handles name another GPU, which the
    # service refuses, as it refused torch 2.11's 66-byte handles on an H100 before the parser
    # knew them. The trainer retries a failed publish; the retry must not be refused again.
    from kuberl.common.weights import publisher as publisher_module

    monkeypatch.setattr(publisher_module, "GpuBuckets", _FakeGpuBuckets)
    monkeypatch.setattr(
        publisher_module,
        "export_cuda_ipc",
        lambda sizes, sets: _fake_cuda_ipc_export("GPU-other", sizes),
    )
    for svc in _service(tmp_path, ["cuda_ipc", "shm", "snapshot"]):
        offer = ["--transports", "cuda_ipc", "shm", "snapshot"]
        engine = _engine(svc, tmp_path, "same-gpu", *offer, "--gpu", "GPU-trainer")
        try:
            _wait(lambda: len(_status(svc).engines) == 1, "engine registered", svc)  # noqa: B023
            with WeightPublisher(svc.address, transports=("shm", "snapshot")) as pub:
                pub.gpu_uuid = "GPU-trainer"  # what a trainer on that GPU would say
                pub.transports = [pb.TRANSPORT_CUDA_IPC, *pub.transports]
                with pytest.raises(grpc.RpcError) as refused:
                    pub.publish(7, iter(make_tensors(7).items()))
                offered_after = (pub.gpu_uuid, list(pub.transports))
                retry = pub.publish(7, iter(make_tensors(7).items()))
            _wait(lambda: "same-gpu" in _holding(svc, 7), "engine at v7", svc)  # noqa: B023
            history = _history(tmp_path, "same-gpu")
            identical = _bit_identical(tmp_path, "same-gpu", 7, 7)
        finally:
            _stop(engine)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert offered_after == ("", [pb.TRANSPORT_SHM, pb.TRANSPORT_SNAPSHOT])
        assert (retry.transport, retry.cuda_ipc_sets, history, identical) == (
            "shm", 0, [(7, "shm")], True,
        )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="role", required=True)
    e = sub.add_parser("engine")
    e.add_argument("address")
    e.add_argument("out")
    e.add_argument("name")
    e.add_argument("--die-after-buckets", type=int, default=0)
    e.add_argument("--stall-after-buckets", type=int, default=0)
    e.add_argument("--register-on-cue", action="store_true")
    e.add_argument("--transports", nargs="+", default=["shm", "gloo", "snapshot"])
    e.add_argument("--device", default="cpu")
    e.add_argument("--gpu", default=None, help="GPU UUID to register with (default: device's)")
    e.add_argument("--shm-in-place", action="store_true")
    e.add_argument("--load-seconds", type=float, default=0.0)
    t = sub.add_parser("trainer")
    t.add_argument("address")
    t.add_argument("version", type=int)
    t.add_argument("seed", type=int)
    t.add_argument("mb", type=float)
    t.add_argument("--transports", nargs="+", default=["shm", "snapshot"])
    t.add_argument("--device", default="cpu")
    t.add_argument("--hold-until-loaded", action="store_true")
    ns = parser.parse_args()
    _engine_main(ns) if ns.role == "engine" else _trainer_main(ns)
