"""Our broadcast groups against SGLang's own group code, for real, on CPU over gloo.

An SGLang server joins a weight-update group with `init_custom_process_group`
(sglang/srt/utils/common.py); the rendezvous keys both ends wait for come from how each builds
its group, so a request body that matches SGLang's schema is not enough. The peer process
(`tests/contract/sglang_weight_peer.py`) runs SGLang 0.5.23's own function, extracted from the
installed source with `ast` and compiled in isolation because the package cannot be imported
here, plus SGLang's `FlattenedTensorBucket`, driven by the JSON bodies our rollout sends SGLang
(`kuberl.common.weights.sglang`). The relay's `BroadcastSender` (rank 0) and our engines'
`BroadcastReceiver` (rank 1) must meet it and move a few tensors of mixed dtypes in several
buckets bit for bit. The control shows the test can fail: a group built the way our code did
before (the backend directly on `PrefixStore(group_name, store)`) never meets SGLang's.

NCCL takes the same path with `backend="nccl"` (the keys differ only by `cuda/` for `cpu/`);
that needs two GPUs and has not run here.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.redis_server import PortReservation
from kuberl.common.weights import Manifest, plan
from kuberl.common.weights import sglang as bodies
from kuberl.common.weights.transports.broadcast import BroadcastReceiver, BroadcastSender
from tests.contract.sglang_weight_peer import sglang_root
from tests.support import REPO

pytestmark = pytest.mark.skipif(
    sglang_root() is None,
    reason="sglang is not installed; run `.venv/bin/pip install --no-deps sglang==0.5.23`",
)

TIMEOUT_S = 90.0


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(16, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 16, generator=g).half(),
        "model.layers.0.counter": torch.randint(-(2**40), 2**40, (3,), generator=g),
        "lm_head.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
    }


def _version(tensors: dict[str, torch.Tensor]) -> tuple[Manifest, torch.Tensor]:
    """The manifest (buckets of at most 2 KiB: three here) and the flat payload."""
    manifest = plan([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], 2048)
    flat = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
    for e in manifest.entries:
        flat[e.flat_offset : e.flat_offset + e.nbytes] = tensors[e.name].view(-1).view(torch.uint8)
    return manifest, flat


def _requests(manifest: Manifest, group: pb.BroadcastGroup, path: Path) -> pb.UpdateInstruction:
    """What the rollout posts to SGLang for this version, written where the peer reads it."""
    instruction = pb.UpdateInstruction(
        version=3,
        transport=pb.TRANSPORT_GLOO,
        manifest=manifest.to_proto(),
        group=group,
        rank=1,
        deadline_seconds=TIMEOUT_S,
    )
    requests = {
        "init": bodies.init_group_request(instruction),
        "updates": bodies.update_requests(instruction),
    }
    path.write_text(json.dumps(requests))
    return instruction


def _peer(mode: str, requests: Path, out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.contract.sglang_weight_peer", mode, requests, out],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )


def _bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose dtype, shape or bytes differ (or that are missing)."""
    return [
        name
        for name, t in want.items()
        if name not in got
        or got[name].dtype != t.dtype
        or got[name].shape != t.shape
        or not torch.equal(got[name].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
    ]


def test_an_sglang_server_joins_the_relays_group_and_receives_every_tensor_bit_identical(
    tmp_path: Path,
) -> None:
    tensors = _tensors()
    manifest, flat = _version(tensors)
    sender = BroadcastSender(
        backend="gloo", advertise_host="127.0.0.1", world_size=2,
        group_name="kuberl-ws-contract-v3-engine", timeout_s=TIMEOUT_S,
    )  # fmt: skip
    _requests(manifest, sender.group, tmp_path / "requests.json")
    peer = _peer("join", tmp_path / "requests.json", tmp_path / "got.safetensors")
    sent: list[int] = []
    try:
        sender.send(manifest, flat, sent.append)
        assert peer.wait(TIMEOUT_S) == 0
    finally:
        peer.kill()
        sender.close()
    got = load_file(str(tmp_path / "got.safetensors"))
    assert manifest.num_buckets == 3
    assert (sent, _bit_identical(got, tensors)) == ([0, 1, 2], [])


def test_our_engine_receiver_joins_a_group_hosted_by_sglangs_own_code(tmp_path: Path) -> None:
    # RL trainers that drive SGLang (verl, slime) host the group with the same function at
    # rank 0; our engines must meet a group formed that way too.
    tensors = _tensors()
    manifest, _ = _version(tensors)
    save_file(tensors, str(tmp_path / "send.safetensors"))
    # Held (bound, never listening) until the peer's TCPStore binds it alongside: no other
    # process can take the port in the seconds the peer spends importing.
    reservation = PortReservation()
    port = reservation.take()
    group = pb.BroadcastGroup(
        group_name="kuberl-contract-hosted", backend="gloo", master_address="127.0.0.1",
        master_port=port, world_size=2,
    )  # fmt: skip
    instruction = _requests(manifest, group, tmp_path / "requests.json")
    peer = _peer("host", tmp_path / "requests.json", tmp_path / "send.safetensors")
    try:
        got_manifest, flat = BroadcastReceiver().receive(instruction)
        assert peer.wait(TIMEOUT_S) == 0
    finally:
        peer.kill()
        reservation.release()
    assert _bit_identical(got_manifest.views(flat), tensors) == []


def test_control_a_group_on_the_bare_prefix_store_never_meets_sglangs(tmp_path: Path) -> None:
    # What BroadcastSender did before: the backend straight on PrefixStore(group_name, store).
    tensors = _tensors()
    manifest, _ = _version(tensors)
    store = dist.TCPStore(
        "127.0.0.1", 0, 2, True, datetime.timedelta(seconds=60), wait_for_workers=False
    )
    group = pb.BroadcastGroup(
        group_name="kuberl-contract-old", backend="gloo", master_address="127.0.0.1",
        master_port=store.port, world_size=2,
    )  # fmt: skip
    _requests(manifest, group, tmp_path / "requests.json")
    peer = _peer("join", tmp_path / "requests.json", tmp_path / "got.safetensors")
    try:
        assert peer.stdout is not None and peer.stdout.readline().strip() == "joining"
        # The peer is in SGLang's rendezvous now and waits there; give it 5 s to meet us.
        result: list[BaseException] = []

        def old_group() -> None:
            try:
                dist.ProcessGroupGloo(
                    dist.PrefixStore(group.group_name, store), 0, 2,
                    datetime.timedelta(seconds=5),
                )  # fmt: skip
            except RuntimeError as exc:
                result.append(exc)

        thread = threading.Thread(target=old_group)
        thread.start()
        thread.join(30)
        peer_still_waiting = peer.poll() is None
    finally:
        peer.kill()
    assert (len(result), peer_still_waiting) == (1, True)
