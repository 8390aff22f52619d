"""CUDA IPC updates of an SGLang server: our /update_weights_from_tensor payloads, read by SGLang's
own code.

SGLang takes only its own payload on that route: base64 of `ForkingPickler`'s bytes, read back
with its `SafeUnpickler` (an allow-list of globals) and handed to its model runner. The peer
(`tests/contract/sglang_tensor_peer.py`) runs those pieces of the installed sglang 0.5.23
source, extracted with `ast`, on the bodies our rollout sends (`kuberl.common.weights.sglang`):

- the payload format, for real, across processes, on CPU: a producer process builds the bodies
  from buckets in shared memory (torch shares a CPU tensor through a shared-memory file the way
  it shares a CUDA tensor through an IPC handle, and the producer keeps it alive until the
  consumer is done, as the trainer does); the SGLang peer process deserializes them and its
  `update_weights_from_tensor` (flattened-bucket format) loads every tensor bit for bit.
- the CUDA form, without a GPU: the bodies made from weight-sync's JSON handle set are read by
  SGLang's unpickler, which must admit every global they name, and its call of torch's
  `rebuild_cuda_tensor` gets the arguments torch's own CUDA reduction writes, filled from the
  handle set (the GPU's UUID where SGLang's reduction patch maps a UUID to its device). Only the
  CUDA call itself is replaced, by one returning the bucket's bytes, so SGLang's loading runs too.

The real CUDA IPC round trip (trainer process, SGLang's code on the same GPU) is
tests/gpu/test_sglang_cuda_ipc.py; a live SGLang server has never run these payloads.
"""

from __future__ import annotations

import base64
import inspect
import io
import json
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.weights import Manifest, plan
from kuberl.common.weights.sglang import tensor_update_requests
from tests.contract.sglang_tensor_peer import load, load_reduction_patch, load_serializer
from tests.contract.sglang_weight_peer import sglang_root
from tests.support import REPO

pytestmark = pytest.mark.skipif(
    sglang_root() is None,
    reason="sglang is not installed; run `.venv/bin/pip install --no-deps sglang==0.5.23`",
)

GPU = "GPU-2f6b1c3e-7d1a-4c55-9a3e-0b9d8e7f6a5c"


def tensors() -> dict[str, torch.Tensor]:
    """A version of mixed dtypes; 1 KiB buckets make three of them."""
    g = torch.Generator().manual_seed(11)
    return {
        "model.embed_tokens.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(16, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(24, 16, generator=g).half(),
        "model.layers.0.counter": torch.randint(-(2**40), 2**40, (3,), generator=g),
        "lm_head.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
    }


def version(named: dict[str, torch.Tensor]) -> tuple[Manifest, list[torch.Tensor]]:
    """The manifest and each bucket's bytes (flat uint8), as the trainer packs them."""
    manifest = plan([(n, t.dtype, tuple(t.shape)) for n, t in named.items()], 1024)
    buckets = [torch.zeros(n, dtype=torch.uint8) for n in manifest.bucket_sizes]
    for e in manifest.entries:
        buckets[e.bucket][e.offset : e.offset + e.nbytes] = named[e.name].view(-1).view(torch.uint8)
    return manifest, buckets


def cuda_ipc_instruction(manifest: Manifest, version_: int = 5, gpu: str = GPU) -> Any:
    """A CUDA IPC instruction with one engine's handle set, well formed and pointing at nothing
    (no GPU here): bucket b's handle is 64 bytes of b+1, its storage 512 bytes into a block, its
    reference counter /torch_ref_b at offset 3b; the last bucket asks for an event sync."""
    last = manifest.num_buckets - 1

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    buckets = [
        {
            "size": [n],
            "stride": [1],
            "offset": 0,
            "dtype": "uint8",
            "handle": b64(bytes([b + 1]) * 64),
            "storage_bytes": n + 512,
            "storage_offset": 512,
            "ref_handle": b64(f"/torch_ref_{b}".encode()),
            "ref_offset": 3 * b,
            "event_handle": b64(bytes([0xE0 + b]) * 64),
            "event_sync": b == last,
        }
        for b, n in enumerate(manifest.bucket_sizes)
    ]
    return pb.UpdateInstruction(
        version=version_,
        transport=pb.TRANSPORT_CUDA_IPC,
        manifest=manifest.to_proto(),
        handles_json=json.dumps({"gpu_uuid": gpu, "buckets": buckets}),
    )


def _bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose dtype, shape or bytes differ (or that are missing or extra)."""
    bad = sorted(set(got) ^ set(want))
    for name, t in want.items():
        if name in got and (
            got[name].dtype != t.dtype
            or got[name].shape != t.shape
            or not torch.equal(got[name].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
        ):
            bad.append(name)
    return bad


# The producer: our code makes the bodies from buckets in shared memory (file_system: a named
# shared-memory file, as a CUDA bucket is a named IPC allocation), then keeps them alive until
# the consumer is done (stdin closes).
PRODUCER = """
import json, sys
import torch.multiprocessing
torch.multiprocessing.set_sharing_strategy("file_system")
from kuberl.common.weights.sglang import tensor_update_bodies
from tests.contract.test_sglang_tensor_update import tensors, version
manifest, buckets = version(tensors())
bodies = tensor_update_bodies(manifest, buckets, 4)
print(json.dumps(bodies), flush=True)
sys.stdin.read()
"""


def test_sglangs_own_code_in_another_process_loads_every_tensor_of_our_payloads_bit_identical(
    tmp_path: Path,
) -> None:
    producer = subprocess.Popen(
        [sys.executable, "-c", PRODUCER], cwd=REPO, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert producer.stdout is not None
        (tmp_path / "bodies.json").write_text(producer.stdout.readline())
        peer = subprocess.run(
            [sys.executable, "-m", "tests.contract.sglang_tensor_peer",
             tmp_path / "bodies.json", tmp_path / "got.safetensors"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        assert producer.stdin is not None
        producer.stdin.close()
        producer.wait(30)
    assert peer.returncode == 0, peer.stderr[-2000:]
    got = load_file(str(tmp_path / "got.safetensors"))
    order = json.loads((tmp_path / "got.safetensors.globals.json").read_text())["order"]
    assert (order, _bit_identical(got, tensors())) == (list(tensors()), [])


class _CudaRebuilds:
    """Stands in for torch's `rebuild_cuda_tensor` (no GPU here): records each call's
    arguments and returns the bytes of the bucket whose handle it names."""

    def __init__(self, buckets: list[torch.Tensor]) -> None:
        self.buckets = buckets
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any) -> torch.Tensor:
        self.calls.append(args)
        return self.buckets[args[7][0] - 1].clone()  # handle: 64 bytes of b+1

    def replace(self, module: str, name: str, found: Any) -> Any:
        # SGLang's unpickler has admitted the global; what it found is SGLang's patched
        # rebuild (monkey_patch_torch_reductions), which would call torch's with the device
        # index of this UUID, and needs the GPU.
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return self
        return found


@pytest.fixture(scope="module")
def from_handles() -> tuple[Manifest, _CudaRebuilds, list[Any], list[str], list[tuple[str, str]]]:
    """SGLang's code run on the bodies made from a CUDA IPC handle set."""
    manifest, buckets = version(tensors())
    bodies = tensor_update_requests(cuda_ipc_instruction(manifest))
    rebuilds = _CudaRebuilds(buckets)
    loaded, asked = load(bodies, rebuilds.replace)
    return manifest, rebuilds, loaded, [b["load_format"] for b in bodies], asked


def test_payloads_from_cuda_ipc_handles_load_every_tensor_through_sglangs_own_code(
    from_handles,
) -> None:
    _, _, loaded, formats, _ = from_handles
    assert formats == ["flattened_bucket"] * 3
    assert ([n for n, _ in loaded], _bit_identical(dict(loaded), tensors())) == (
        list(tensors()),
        [],
    )


def test_each_bucket_is_torchs_cuda_reduction_of_the_trainers_bucket_named_by_its_handle(
    from_handles,
) -> None:
    manifest, rebuilds, _, _, _ = from_handles
    handles = json.loads(cuda_ipc_instruction(manifest).handles_json)["buckets"]
    # What torch's reduce_tensor writes for a flat uint8 CUDA tensor (its argument order),
    # with SGLang's device-as-UUID.
    want = [
        (
            torch.Tensor,
            torch.Size(h["size"]),
            (1,),
            0,
            torch.storage.TypedStorage,
            torch.uint8,
            GPU,
            base64.b64decode(h["handle"]),
            h["storage_bytes"],
            h["storage_offset"],
            False,
            base64.b64decode(h["ref_handle"]),
            h["ref_offset"],
            base64.b64decode(h["event_handle"]),
            h["event_sync"],
        )
        for h in handles
    ]
    assert rebuilds.calls == want


def test_the_call_fits_torchs_rebuild_and_puts_the_gpu_uuid_where_sglang_maps_it(
    from_handles,
) -> None:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    root = sglang_root()
    assert root is not None
    _, rebuilds, _, _, _ = from_handles
    arity = len(inspect.signature(rebuild_cuda_tensor).parameters)
    device_at = load_reduction_patch(root)["_REDUCE_TENSOR_ARG_DEVICE_INDEX"]
    assert {(len(c), c[device_at]) for c in rebuilds.calls} == {(arity, GPU)}


def test_every_global_the_payloads_name_is_on_sglangs_allow_list(from_handles) -> None:
    root = sglang_root()
    assert root is not None
    _, _, _, _, asked = from_handles
    allowed = load_serializer(root)["SafeUnpickler"].ALLOWED_GLOBALS
    assert ("torch.multiprocessing.reductions", "rebuild_cuda_tensor") in asked
    assert set(asked) - allowed == set()


def test_a_handle_set_that_does_not_fit_the_manifest_is_refused_before_any_body_is_made() -> None:
    manifest, _ = version(tensors())
    other, _ = version({"w": torch.zeros(4)})
    instruction = cuda_ipc_instruction(other)
    instruction.manifest.CopyFrom(manifest.to_proto())
    with pytest.raises(ValueError, match="1 buckets for the manifest's 3"):
        tensor_update_requests(instruction)


def test_a_handle_set_naming_no_gpu_is_refused() -> None:
    manifest, _ = version(tensors())
    with pytest.raises(ValueError, match="must name its GPU"):
        tensor_update_requests(cuda_ipc_instruction(manifest, gpu=""))


def test_control_sglangs_unpickler_refuses_a_payload_naming_a_class_off_its_allow_list() -> None:
    # What the metadata would be with our own dataclass in place of SimpleNamespace.
    manifest, _ = version(tensors())
    buf = io.BytesIO()
    ForkingPickler(buf).dump({"flattened_tensor": None, "metadata": manifest.bucket_entries(0)})
    body = {
        "serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()],
        "load_format": "flattened_bucket",
    }
    with pytest.raises(RuntimeError, match=r"Blocked unsafe global \(kuberl\..*TensorEntry\)"):
        load([body])
