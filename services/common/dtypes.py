"""Bytes per element of the tensor dtypes kuberl moves, by torch's name: sizes are checked in
services that never import torch (buffer, weight-sync)."""

from __future__ import annotations

ITEMSIZES = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
