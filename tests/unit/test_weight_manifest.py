"""The version layout (buckets, offsets, SGLang's flattened_bucket) and the checked snapshot
chunk stream of `kuberl.common.weights`, against hand-computed layouts and real safetensors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as safetensors_load

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.weights import Manifest, ManifestBuilder, plan, safetensors_header
from kuberl.common.weights.chunks import ChunkReceiver, CorruptSnapshot, iter_chunks


def _flat(manifest: Manifest, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    flat = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
    for e in manifest.entries:
        flat[e.flat_offset : e.flat_offset + e.nbytes] = (
            tensors[e.name].reshape(-1).view(torch.uint8)
        )
    return flat


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),  # 256 B
        "norm.weight": torch.randn(8, generator=g),  # 32 B
        "mask": torch.tensor([True, False, True]),  # 3 B
        "head.bias": torch.randn(5, generator=g).to(torch.float16),  # 10 B
        "big": torch.randn(100, generator=g),  # 400 B
    }


def test_tensors_are_packed_back_to_back_and_start_a_bucket_when_full_or_unaligned() -> None:
    specs = [(n, t.dtype, t.shape) for n, t in _tensors().items()]
    manifest = plan(specs, bucket_bytes=300)
    layout = [(e.name, e.bucket, e.offset, e.flat_offset) for e in manifest.entries]
    # embed 256 B + norm 32 B + mask 3 B = 291 <= 300 share bucket 0; head (fp16, 2-byte
    # elements) at offset 291 would be unaligned -> bucket 1; big (400 B > 300) travels alone.
    assert layout == [
        ("embed.weight", 0, 0, 0),
        ("norm.weight", 0, 256, 256),
        ("mask", 0, 288, 288),
        ("head.bias", 1, 0, 291),
        ("big", 2, 0, 301),
    ]


def test_views_over_the_flat_payload_are_bit_identical_even_when_unaligned() -> None:
    tensors = _tensors()
    manifest = plan([(n, t.dtype, t.shape) for n, t in tensors.items()], bucket_bytes=300)
    views = manifest.views(_flat(manifest, tensors))
    assert all(
        torch.equal(views[n].view(torch.uint8), t.view(torch.uint8)) for n, t in tensors.items()
    )


def test_manifest_survives_its_proto_round_trip() -> None:
    tensors = _tensors()
    manifest = plan([(n, t.dtype, t.shape) for n, t in tensors.items()], bucket_bytes=300)
    again = Manifest.from_proto(manifest.to_proto())
    assert (again.entries, again.bucket_sizes) == (manifest.entries, manifest.bucket_sizes)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (pb.TensorSpec(name="a", dtype="complex64", shape=[2], nbytes=16), "unknown dtype"),
        (pb.TensorSpec(name="a", dtype="float32", shape=[2], nbytes=7), "nbytes 7 != 8"),
        (pb.TensorSpec(name="a", dtype="float32", shape=[2], nbytes=8, offset=4), "packed back"),
        (pb.TensorSpec(name="a", dtype="float32", shape=[2], nbytes=8, bucket=3), "out of order"),
        # A first bucket of -1 once raised IndexError: INTERNAL at CommitPublish, not refused.
        (pb.TensorSpec(name="a", dtype="float32", shape=[2], nbytes=8, bucket=-1), "out of order"),
    ],
)
def test_an_inconsistent_manifest_is_rejected_with_the_reason(spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        Manifest.from_proto(pb.Manifest(tensors=[spec]))


def test_header_plus_payload_is_a_safetensors_file_with_the_same_tensors() -> None:
    tensors = _tensors()
    manifest = plan([(n, t.dtype, t.shape) for n, t in tensors.items()], bucket_bytes=300)
    blob = safetensors_header(manifest) + _flat(manifest, tensors).numpy().tobytes()
    loaded = safetensors_load(blob)
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_the_builder_refuses_a_name_given_twice() -> None:
    builder = ManifestBuilder(1024)
    builder.add("w", torch.float32, (2,))
    with pytest.raises(ValueError, match="given twice"):
        builder.add("w", torch.float32, (2,))


def _chunks(payload: bytes, chunk_bytes: int = 64) -> list[pb.SnapshotChunk]:
    manifest = plan([("w", torch.uint8, (len(payload),))], bucket_bytes=1 << 20)
    pieces = [payload[:100], payload[100:]]
    return list(iter_chunks(7, pieces, chunk_bytes=chunk_bytes, manifest_last=lambda: manifest))


def _receive(chunks: list[pb.SnapshotChunk]) -> bytes:
    out = bytearray()

    def write(offset: int, data: bytes) -> None:
        assert offset == len(out)
        out.extend(data)

    receiver = ChunkReceiver(write, version=7)
    for chunk in chunks:
        receiver.feed(chunk)
    receiver.finish()
    return bytes(out)


def test_a_chunk_stream_reassembles_the_exact_payload() -> None:
    payload = bytes(range(256)) * 3
    chunks = _chunks(payload)
    assert (len(chunks), _receive(chunks)) == (12, payload)


def test_a_chunk_with_a_flipped_byte_is_rejected_by_its_crc32c() -> None:
    chunks = _chunks(bytes(range(256)) * 3)
    data = bytearray(chunks[3].data)
    data[5] ^= 0x01
    chunks[3].data = bytes(data)
    with pytest.raises(CorruptSnapshot, match="CRC32C mismatch at offset 192"):
        _receive(chunks)


def test_a_stream_cut_before_its_last_chunk_is_rejected_as_truncated() -> None:
    with pytest.raises(CorruptSnapshot, match="truncated"):
        _receive(_chunks(bytes(range(256)) * 3)[:-1])


def test_a_missing_chunk_is_rejected_as_out_of_order() -> None:
    chunks = _chunks(bytes(range(256)) * 3)
    with pytest.raises(CorruptSnapshot, match="expected 128"):
        _receive(chunks[:2] + chunks[3:])


def test_a_consistent_but_wrong_payload_fails_the_final_sha256() -> None:
    chunks = _chunks(bytes(range(256)) * 3)
    chunks[-1].sha256 = "0" * 64
    with pytest.raises(CorruptSnapshot, match="SHA-256 mismatch"):
        _receive(chunks)


def test_every_syncable_dtype_has_torchs_element_size() -> None:
    from kuberl.common.dtypes import ITEMSIZES
    from kuberl.common.weights.manifest import SAFETENSORS_DTYPES, torch_dtype

    assert set(ITEMSIZES) == set(SAFETENSORS_DTYPES)
    assert {n: torch_dtype(n).itemsize for n in ITEMSIZES} == ITEMSIZES
