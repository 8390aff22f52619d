"""The layout of one policy version: which tensor sits where in which broadcast bucket.

The trainer's publisher, the engines' client and the weight-sync service share it. A version travels
as one flat byte payload of buckets laid back to back, each SGLang's `flattened_bucket` layout
(tensors' raw bytes packed with no padding), so an SGLang engine receives a bucket natively with one
broadcast; the same payload is the data section of a safetensors file (`safetensors_header`).
`ManifestBuilder` assigns places as the trainer's tensors stream by, so the whole model never has to
be materialised; `Manifest.views` turns a received flat buffer into named tensors without a copy.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.dtypes import ITEMSIZES

if TYPE_CHECKING:
    import torch

#: dtype name on the wire (torch's name without "torch.") -> safetensors' name.
SAFETENSORS_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the name used in manifests and SGLang requests)."""
    name = str(dtype).removeprefix("torch.")
    if name not in SAFETENSORS_DTYPES:
        raise ValueError(f"dtype {dtype} cannot be synced; supported: {sorted(SAFETENSORS_DTYPES)}")
    return name


def itemsize(name: str) -> int:
    """ "bfloat16" -> 2; ValueError naming the supported dtypes otherwise."""
    if name not in ITEMSIZES:
        raise ValueError(f"unknown dtype {name!r}; supported: {sorted(SAFETENSORS_DTYPES)}")
    return ITEMSIZES[name]


def torch_dtype(name: str) -> torch.dtype:
    """ "bfloat16" -> torch.bfloat16; ValueError naming the supported dtypes otherwise."""
    import torch

    itemsize(name)
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place: `offset` inside its bucket, `flat_offset` inside the whole payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int
    flat_offset: int


@dataclass
class Manifest:
    """Every tensor of a version and the bucket sizes; `total_bytes` is the payload's length."""

    entries: list[TensorEntry]
    bucket_bytes: int
    bucket_sizes: list[int] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_sizes)

    @property
    def bucket_starts(self) -> list[int]:
        starts, at = [], 0
        for size in self.bucket_sizes:
            starts.append(at)
            at += size
        return starts

    def bucket_entries(self, bucket: int) -> list[TensorEntry]:
        return [e for e in self.entries if e.bucket == bucket]

    def bucket_view(self, flat: torch.Tensor, bucket: int) -> torch.Tensor:
        """The bytes of one bucket inside a flat uint8 payload (a view, no copy)."""
        start = self.bucket_starts[bucket]
        return flat[start : start + self.bucket_sizes[bucket]]

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named tensors over a flat uint8 payload [total_bytes]: views where the byte offset is
        aligned for the dtype, copies otherwise (torch cannot view unaligned memory)."""
        import torch

        if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != self.total_bytes:
            raise ValueError(
                f"payload must be a flat uint8 tensor of {self.total_bytes} bytes, got "
                f"{flat.dtype} {tuple(flat.shape)}"
            )
        out: dict[str, torch.Tensor] = {}
        for e in self.entries:
            dtype = torch_dtype(e.dtype)
            raw = flat[e.flat_offset : e.flat_offset + e.nbytes]
            if e.flat_offset % dtype.itemsize:
                raw = raw.clone()
            out[e.name] = raw.view(dtype).view(e.shape)
        return out

    def to_proto(self) -> pb.Manifest:
        return pb.Manifest(
            tensors=[
                pb.TensorSpec(
                    name=e.name,
                    dtype=e.dtype,
                    shape=list(e.shape),
                    bucket=e.bucket,
                    offset=e.offset,
                    nbytes=e.nbytes,
                )
                for e in self.entries
            ],
            bucket_bytes=self.bucket_bytes,
            total_bytes=self.total_bytes,
            num_buckets=self.num_buckets,
        )

    @classmethod
    def from_proto(cls, msg: pb.Manifest) -> Manifest:
        """Rebuild and validate a manifest; ValueError names the first inconsistency."""
        if not msg.tensors:
            raise ValueError("manifest lists no tensors")
        sizes: list[int] = []
        names: set[str] = set()
        for spec in msg.tensors:
            where = f"manifest tensor {spec.name!r}"
            if not spec.name or spec.name in names:
                raise ValueError(f"{where}: names must be non-empty and unique")
            names.add(spec.name)
            size = itemsize(spec.dtype)
            if any(d < 0 for d in spec.shape):
                raise ValueError(f"{where}: negative dimension in shape {list(spec.shape)}")
            expected = math.prod(spec.shape) * size
            if spec.nbytes != expected:
                raise ValueError(f"{where}: nbytes {spec.nbytes} != {expected} for its shape/dtype")
            if spec.bucket == len(sizes):
                sizes.append(0)
            if not sizes or spec.bucket != len(sizes) - 1:  # (a first bucket of -1: IndexError)
                raise ValueError(f"{where}: bucket {spec.bucket} out of order")
            if spec.offset != sizes[-1]:
                raise ValueError(
                    f"{where}: offset {spec.offset} in bucket {spec.bucket}, expected "
                    f"{sizes[-1]} (tensors are packed back to back)"
                )
            sizes[-1] += spec.nbytes
        manifest = cls(entries=[], bucket_bytes=msg.bucket_bytes, bucket_sizes=sizes)
        starts = manifest.bucket_starts
        manifest.entries = [
            TensorEntry(
                s.name,
                s.dtype,
                tuple(s.shape),
                s.bucket,
                s.offset,
                s.nbytes,
                starts[s.bucket] + s.offset,
            )
            for s in msg.tensors
        ]
        if msg.total_bytes and msg.total_bytes != manifest.total_bytes:
            raise ValueError(
                f"manifest total_bytes {msg.total_bytes} != {manifest.total_bytes} (sum of tensors)"
            )
        if msg.num_buckets and msg.num_buckets != manifest.num_buckets:
            raise ValueError(f"manifest num_buckets {msg.num_buckets} != {manifest.num_buckets}")
        return manifest


class ManifestBuilder:
    """Assigns each tensor its bucket and offset as tensors arrive, one at a time. A tensor
    starts a new bucket when the current one would exceed `bucket_bytes` (a larger tensor
    travels alone) or when its offset would not be a multiple of its element size (SGLang
    rejects unaligned tensors)."""

    def __init__(self, bucket_bytes: int) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self._entries: list[TensorEntry] = []
        self._sizes: list[int] = []
        self._names: set[str] = set()

    @property
    def total_bytes(self) -> int:
        return sum(self._sizes)

    def add(self, name: str, dtype: torch.dtype | str, shape: Sequence[int]) -> TensorEntry:
        """Place the next tensor; return where its bytes go."""
        if name in self._names:
            raise ValueError(f"tensor {name!r} given twice")
        dname = dtype if isinstance(dtype, str) else dtype_name(dtype)
        size = itemsize(dname)
        nbytes = math.prod(shape) * size
        if (
            not self._sizes
            or (self._sizes[-1] and self._sizes[-1] + nbytes > self.bucket_bytes)
            or self._sizes[-1] % size
        ):
            self._sizes.append(0)
        bucket, offset = len(self._sizes) - 1, self._sizes[-1]
        entry = TensorEntry(
            name, dname, tuple(int(d) for d in shape), bucket, offset, nbytes,
            self.total_bytes,
        )  # fmt: skip
        self._sizes[-1] += nbytes
        self._entries.append(entry)
        self._names.add(name)
        return entry

    def build(self) -> Manifest:
        if not self._entries:
            raise ValueError("no tensors were given")
        return Manifest(list(self._entries), self.bucket_bytes, list(self._sizes))


def plan(
    specs: Iterable[tuple[str, torch.dtype | str, Sequence[int]]], bucket_bytes: int
) -> Manifest:
    """A manifest for tensors known up front as (name, dtype, shape)."""
    builder = ManifestBuilder(bucket_bytes)
    for name, dtype, shape in specs:
        builder.add(name, dtype, shape)
    return builder.build()


def safetensors_header(manifest: Manifest) -> bytes:
    """The bytes that, put before the flat payload, make it a valid .safetensors file."""
    header = {
        e.name: {
            "dtype": SAFETENSORS_DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [e.flat_offset, e.flat_offset + e.nbytes],
        }
        for e in manifest.entries
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads its header to 8 bytes
    return struct.pack("<Q", len(text)) + text
