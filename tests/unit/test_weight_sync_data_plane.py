"""The weight-sync data plane without a service: engines' double buffers, the shared-memory
receiver's reused mapping, the relay's recycled segments, the broadcast code that gloo and NCCL
share (run over gloo), and the CUDA IPC handle sets as JSON (checked here without CUDA)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.weights import plan
from kuberl.common.weights.transports import BufferPool
from kuberl.common.weights.transports.broadcast import BroadcastReceiver, BroadcastSender, wait_work
from kuberl.common.weights.transports.cuda_ipc import (
    CudaIpcReceiver,
    parse_cuda_ipc,
    split_cuda_ipc,
)
from kuberl.common.weights.transports.shm import ShmReceiver
from kuberl.weight_sync.store import DigestMismatch, VersionStore

KB = 1024


def _manifest(nbytes: int = 4 * KB, bucket_bytes: int = 1 * KB):  # type: ignore[no-untyped-def]
    return plan([(f"w{i}", torch.uint8, (KB,)) for i in range(nbytes // KB)], bucket_bytes)


def _instruction(manifest, transport: int, **kw) -> pb.UpdateInstruction:  # type: ignore[no-untyped-def]
    return pb.UpdateInstruction(
        version=1, transport=transport, manifest=manifest.to_proto(), deadline_seconds=20, **kw
    )  # type: ignore[arg-type]


# ---------------------------------------------------------------- engine buffers


def test_a_version_is_received_into_the_buffer_the_engine_does_not_hold() -> None:
    pool = BufferPool()
    first = pool.spare(100, "cpu")
    pool.hold(first)
    second = pool.spare(100, "cpu")
    failed_retry = pool.spare(100, "cpu")  # the update into `second` failed: not held
    pool.hold(second)
    third = pool.spare(100, "cpu")
    ptrs = [t.data_ptr() for t in (first, second, failed_retry, third)]
    assert ptrs[0] != ptrs[1] and ptrs[2] == ptrs[1] and ptrs[3] == ptrs[0]


def test_the_shm_receiver_copies_each_version_into_the_spare_buffer_leaving_the_held_one(
    tmp_path: Path,
) -> None:
    manifest = _manifest()
    path = tmp_path / "seg0.bin"
    pool, receiver = BufferPool(), ShmReceiver()
    instruction = _instruction(
        manifest, pb.TRANSPORT_SHM, handles_json=json.dumps({"path": str(path)})
    )
    path.write_bytes(bytes([1]) * manifest.total_bytes)
    _, v1 = receiver.receive(instruction, pool)
    pool.hold(v1)
    with open(path, "r+b") as f:  # the relay recycles the file: rewritten in place
        f.write(bytes([2]) * manifest.total_bytes)
    _, v2 = receiver.receive(instruction, pool)
    assert (int(v1.min()), int(v1.max()), int(v2.min()), int(v2.max())) == (1, 1, 2, 2)


def test_the_shm_receiver_lets_go_of_files_the_relay_deleted_keeping_what_is_in_use(
    tmp_path: Path,
) -> None:
    # The relay deletes a segment (a failed or superseded publish, a retired one) and makes new
    # ones under new names: the receiver must not keep a deleted file's pages mapped for good,
    # yet an in-place engine's weights on such a file stay as they were.
    manifest = _manifest()
    receiver = ShmReceiver(in_place=True)

    def receive(name: str, fill: int) -> torch.Tensor:
        path = tmp_path / name
        path.write_bytes(bytes([fill]) * manifest.total_bytes)
        handle = json.dumps({"path": str(path)})
        return receiver.receive(_instruction(manifest, pb.TRANSPORT_SHM, handles_json=handle))[1]

    held = receive("seg0.bin", 1)
    receive("seg1.bin", 2)
    (tmp_path / "seg0.bin").unlink()
    receive("seg2.bin", 3)
    assert sorted(Path(p).name for p in receiver._maps) == ["seg1.bin", "seg2.bin"]
    assert (int(held.min()), int(held.max())) == (1, 1)


def test_the_shm_receiver_refuses_a_file_shorter_than_the_manifest(tmp_path: Path) -> None:
    manifest = _manifest()
    path = tmp_path / "seg0.bin"
    path.write_bytes(b"\0" * (manifest.total_bytes - 1))
    handle = json.dumps({"path": str(path)})
    with pytest.raises(ValueError, match="truncated shared memory"):
        ShmReceiver().receive(_instruction(manifest, pb.TRANSPORT_SHM, handles_json=handle))


# ---------------------------------------------------------------- relay segments


def _write(store: VersionStore, version: int, fill: int, nbytes: int = 4 * KB) -> str:
    path = store.reserve(version)
    with open(path, "r+b") as f:
        f.truncate(nbytes)
        f.write(bytes([fill]) * nbytes)
    return path


def test_a_segment_is_reused_only_when_it_holds_no_kept_version_and_nobody_reads_it(
    tmp_path: Path,
) -> None:
    store = VersionStore(tmp_path / "store", retain=1)
    manifest = _manifest()
    paths = {1: _write(store, 1, 1)}
    store.commit(1, manifest, uploaded=False)
    paths[2] = _write(store, 2, 2)  # v1 is kept: a new segment
    v2 = store.commit(2, manifest, uploaded=False)  # v1 pruned, its segment free
    paths[3] = _write(store, 3, 3)  # reuses v1's
    store.pin(v2)  # an engine still copies v2
    store.commit(3, manifest, uploaded=False)  # v2 pruned but read: not reusable
    paths[4] = _write(store, 4, 4)  # seg0 holds v3 (kept), seg1 v2 (read): a new one
    store.unpin(v2)
    paths[5] = _write(store, 5, 5)  # v2's segment is free now
    names = {v: Path(p).name for v, p in paths.items()}
    assert names == {1: "seg0.bin", 2: "seg1.bin", 3: "seg0.bin", 4: "seg2.bin", 5: "seg1.bin"}
    store.close()


def test_a_discarded_write_deletes_its_segment_rather_than_reusing_it(tmp_path: Path) -> None:
    store = VersionStore(tmp_path / "store", retain=1)
    first = _write(store, 1, 1)
    store.discard(1)  # superseded: the trainer may still be writing into it
    second = store.reserve(2)
    assert (os.path.exists(first), Path(first).name, Path(second).name) == (
        False,
        "seg0.bin",
        "seg1.bin",
    )
    store.close()


def test_a_commit_with_the_wrong_digest_or_size_changes_nothing(tmp_path: Path) -> None:
    store = VersionStore(tmp_path / "store", retain=1)
    manifest = _manifest()
    _write(store, 1, 1)
    with pytest.raises(DigestMismatch):
        store.commit(1, manifest, uploaded=False, sha256="0" * 64)
    _write(store, 1, 1, nbytes=manifest.total_bytes + 1)
    with pytest.raises(ValueError, match="payload has"):
        store.commit(1, manifest, uploaded=False)
    assert (store.latest(), [s.version for s in store.segments]) == (None, [0])
    store.close()


def _sealed(store: VersionStore, version: int, fill: int) -> str:
    path = _write(store, version, fill)
    store.seal(store.commit(version, _manifest(), uploaded=False))
    return path


def test_a_reopened_store_takes_back_its_newest_sealed_version_bit_identical(
    tmp_path: Path,
) -> None:
    store = VersionStore(tmp_path / "store", retain=2)
    _sealed(store, 1, 1)
    _sealed(store, 2, 2)  # the process dies here: nothing is closed
    reopened = VersionStore(tmp_path / "store", retain=2, restore=True)
    latest = reopened.latest()
    assert latest is not None
    assert (latest.version, bytes(latest.flat)) == (2, bytes([2]) * 4 * KB)


@pytest.mark.parametrize("damage", ["truncated", "flipped_byte", "garbled_record"])
def test_a_damaged_newest_version_is_skipped_for_the_older_complete_one(
    tmp_path: Path, damage: str
) -> None:
    store = VersionStore(tmp_path / "store", retain=2)
    _sealed(store, 1, 1)
    newest = Path(_sealed(store, 2, 2))
    if damage == "truncated":
        os.truncate(newest, 4 * KB - 1)
    elif damage == "flipped_byte":
        with open(newest, "r+b") as f:
            f.seek(1000)
            f.write(b"\x03")
    else:
        newest.with_suffix(".json").write_text('{"version": 2, "sha2')
    reopened = VersionStore(tmp_path / "store", retain=2, restore=True)
    latest = reopened.latest()
    assert (latest.version if latest else None, sorted(reopened.versions)) == (1, [1])


def test_a_store_whose_only_version_is_corrupt_restores_nothing_and_deletes_it(
    tmp_path: Path,
) -> None:
    store = VersionStore(tmp_path / "store", retain=1)
    path = Path(_sealed(store, 1, 1))
    os.truncate(path, 100)
    reopened = VersionStore(tmp_path / "store", retain=1, restore=True)
    assert (reopened.latest(), sorted(p.name for p in reopened.directory.iterdir())) == (None, [])


def test_a_segment_being_rewritten_for_a_new_version_is_never_restored_as_its_old_one(
    tmp_path: Path,
) -> None:
    store = VersionStore(tmp_path / "store", retain=1)
    _sealed(store, 1, 1)
    _sealed(store, 2, 2)  # v1 pruned: its segment is free
    rewritten = Path(store.reserve(3))  # reuses v1's segment; the trainer dies halfway through
    vouched = rewritten.with_suffix(".json").exists()
    with open(rewritten, "r+b") as f:
        f.write(bytes([3]) * KB)
    reopened = VersionStore(tmp_path / "store", retain=1, restore=True)
    latest = reopened.latest()
    assert (vouched, latest.version if latest else None, rewritten.exists()) == (False, 2, False)


def test_a_restored_segment_is_deleted_once_pruned_never_rewritten(tmp_path: Path) -> None:
    # An engine of the previous run may serve from the restored file in place: never write it.
    store = VersionStore(tmp_path / "store", retain=1)
    restored_path = _sealed(store, 1, 1)
    reopened = VersionStore(tmp_path / "store", retain=1, restore=True)
    paths = [_write(reopened, 2, 2)]
    reopened.commit(2, _manifest(), uploaded=False)  # v1 pruned
    paths.append(_write(reopened, 3, 3))  # a new segment, named after the restored one
    assert (os.path.exists(restored_path), [Path(p).name for p in paths]) == (
        False,
        ["seg1.bin", "seg2.bin"],
    )
    reopened.close()


def test_a_store_opened_without_restore_deletes_what_a_previous_run_left(tmp_path: Path) -> None:
    store = VersionStore(tmp_path / "store", retain=1)
    _sealed(store, 1, 1)
    reopened = VersionStore(tmp_path / "store", retain=1)
    assert (reopened.latest(), sorted(p.name for p in reopened.directory.iterdir())) == (None, [])


# ---------------------------------------------------------------- broadcast (gloo here)


# The engine's end of a group, in a process of its own: torch registers a group by name per
# process (as SGLang's groups are), so the two ranks of one group never share a process.
_RECEIVE_IN_CHILD = """
import sys
from pathlib import Path
from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.weights.transports import BufferPool
from kuberl.common.weights.transports.broadcast import BroadcastReceiver
instruction = pb.UpdateInstruction.FromString(Path(sys.argv[1]).read_bytes())
_, flat = BroadcastReceiver().receive(instruction, BufferPool())
Path(sys.argv[2]).write_bytes(flat.numpy().tobytes())
"""


def test_the_broadcast_code_path_moves_every_bucket_bit_identical_with_staging(
    tmp_path: Path,
) -> None:
    # NCCL runs the same sender and receiver with backend="nccl" and a CUDA device; staging is
    # what the relay does for NCCL (host payload -> one reused device buffer per bucket).
    manifest = _manifest(nbytes=5 * KB, bucket_bytes=2 * KB)  # buckets of 2, 2 and 1 KiB
    payload = torch.randint(0, 256, (manifest.total_bytes,), dtype=torch.uint8)
    sender = BroadcastSender(
        backend="gloo", advertise_host="127.0.0.1", world_size=2, group_name="unit",
        timeout_s=60, stage=True,
    )  # fmt: skip
    instruction = _instruction(manifest, pb.TRANSPORT_GLOO, group=sender.group, rank=1)
    instruction.deadline_seconds = 60
    (tmp_path / "instruction.pb").write_bytes(instruction.SerializeToString())
    engine = subprocess.Popen(
        [sys.executable, "-c", _RECEIVE_IN_CHILD, tmp_path / "instruction.pb", tmp_path / "got"]
    )
    sent: list[int] = []
    try:
        sender.send(manifest, payload, sent.append)
        assert engine.wait(60) == 0
    finally:
        engine.kill()
        sender.close()
    got = torch.frombuffer(bytearray((tmp_path / "got").read_bytes()), dtype=torch.uint8)
    assert (sent, torch.equal(got, payload)) == ([0, 1, 2], True)


def test_an_nccl_sender_or_receiver_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        BroadcastSender(
            backend="nccl", advertise_host="127.0.0.1", world_size=2, group_name="x",
            timeout_s=1, device="cpu",
        )  # fmt: skip
    group = pb.BroadcastGroup(backend="nccl", master_address="127.0.0.1", master_port=1)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        BroadcastReceiver("cpu").receive(_instruction(_manifest(), pb.TRANSPORT_NCCL, group=group))


class _FakeStuckWork:
    """Stand-in for an NCCL Work whose peer never joins (no GPU here to make a real one)."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        raise AssertionError("wait must not be called on a stuck NCCL work")


class _FakeGroup:
    aborted = False

    def abort(self) -> None:
        self.aborted = True


def test_an_nccl_collective_that_does_not_finish_is_aborted_at_the_deadline() -> None:
    group = _FakeGroup()
    with pytest.raises(TimeoutError, match="aborted"):
        wait_work(_FakeStuckWork(), group, "nccl", timeout_s=1.0)
    assert group.aborted


# ---------------------------------------------------------------- CUDA IPC handles (no CUDA)


def _bucket(nbytes: int, seed: int) -> dict:
    handle = bytes((seed + i) % 256 for i in range(64))
    return {
        "size": [nbytes], "stride": [1], "offset": 0, "dtype": "uint8",
        "handle": base64.b64encode(handle).decode(), "storage_bytes": nbytes,
        "storage_offset": 0, "ref_handle": base64.b64encode(b"/torch_123_456").decode(),
        "ref_offset": seed, "event_handle": base64.b64encode(bytes(64)).decode(),
        "event_sync": True,
    }  # fmt: skip


def _export(manifest, sets: int = 2) -> dict:  # type: ignore[no-untyped-def]
    return {
        "gpu_uuid": "GPU-test",
        "sets": [
            {"buckets": [_bucket(n, 10 * s + b) for b, n in enumerate(manifest.bucket_sizes)]}
            for s in range(sets)
        ],
    }


def test_cuda_ipc_handle_sets_split_per_engine_and_round_trip_through_json() -> None:
    manifest = _manifest()
    export = _export(manifest)
    sets = split_cuda_ipc(json.dumps(export), manifest)
    again = [parse_cuda_ipc(s.to_json(), manifest) for s in sets]
    wire = json.loads(sets[1].to_json())  # what one engine's UpdateInstruction carries
    assert (len(sets), again, wire["gpu_uuid"]) == (2, sets, "GPU-test")
    assert wire["buckets"] == export["sets"][1]["buckets"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda e: e.pop("gpu_uuid"), "gpu_uuid"),
        (lambda e: e.update(sets=[]), "at least one set"),
        (lambda e: e["sets"][0]["buckets"].pop(), "buckets for the manifest's 4"),
        (lambda e: e["sets"][1]["buckets"][0].update(size=[999]), "has 999 bytes"),
        (lambda e: e["sets"][0]["buckets"][2].update(handle="not base64!"), "not valid base64"),
        (lambda e: e["sets"][0]["buckets"][2].update(handle=""), "0 bytes, expected 1 to"),
        (
            lambda e: e["sets"][0]["buckets"][2].update(
                handle=base64.b64encode(bytes(65537)).decode()
            ),
            "65537 bytes, expected 1 to 65536",
        ),
        (lambda e: e["sets"][0]["buckets"][2].update(event_handle="AAAA"), "expected 64"),
        (lambda e: e["sets"][0]["buckets"][0].update(offset=-1), "non-negative integer"),
        (lambda e: e["sets"][0]["buckets"][0].update(ref_offset=True), "non-negative integer"),
        (lambda e: e["sets"][0]["buckets"][0].update(dtype="float32"), "flat uint8"),
        (lambda e: e["sets"][0]["buckets"][0].update(storage_bytes=10), "past its storage"),
    ],
    ids=[
        "no gpu", "no sets", "bucket missing", "wrong size", "bad base64", "empty handle",
        "huge handle", "short event handle",
        "negative", "bool as int", "dtype", "past storage",
    ],
)  # fmt: skip
def test_malformed_cuda_ipc_exports_are_refused_with_the_field_named(damage, message) -> None:  # type: ignore[no-untyped-def]
    manifest = _manifest()
    export = _export(manifest)
    damage(export)
    with pytest.raises(ValueError, match=message):
        split_cuda_ipc(json.dumps(export), manifest)


def test_cuda_ipc_handles_that_are_not_json_are_refused_not_evaluated() -> None:
    for text in ("\x80\x04K.", "[" * 100_000, "{'buckets': []}"):
        with pytest.raises(ValueError):
            split_cuda_ipc(text)


def test_the_cuda_ipc_receiver_checks_handles_before_it_needs_cuda() -> None:
    manifest = _manifest()
    good = split_cuda_ipc(json.dumps(_export(manifest)), manifest)[0].to_json()
    bad = json.dumps({"gpu_uuid": "GPU-test", "buckets": []})
    receiver = CudaIpcReceiver("cpu")
    with pytest.raises(ValueError, match="no buckets"):
        receiver.receive(_instruction(manifest, pb.TRANSPORT_CUDA_IPC, handles_json=bad))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        receiver.receive(_instruction(manifest, pb.TRANSPORT_CUDA_IPC, handles_json=good))
