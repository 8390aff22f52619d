"""benchmarks/lora_sync.py without running it (the timed run belongs to `make bench`): its adapter
version is what weight-sync carries for a LoRA job, a small share of the full model, and its
figures become the report's rows."""

from __future__ import annotations

import torch

from kuberl.common.lora import is_adapter_tensor
from tests.benchmarks import load

bench = load("lora_sync")
report = load("report")


def test_the_adapters_are_r16_on_every_linear_of_qwen2_0_5b_and_under_5_percent_of_it() -> None:
    shapes = bench.adapter_shapes(16)
    params = sum(torch.Size(s).numel() for _, s in shapes)
    full = bench.nbytes(bench.qwen05b_shapes(1.0))
    assert (len(shapes), round(params / 1e6, 2), all(is_adapter_tensor(n) for n, _ in shapes)) == (
        24 * 7 * 2,
        8.80,
        True,
    )
    assert 0.01 < bench.nbytes(shapes) / full < 0.05


def test_each_adapter_matrix_fits_its_layer() -> None:
    # A is [r, in], B [out, r] for a layer of the full model's [out, in].
    full = dict(bench.qwen05b_shapes(1.0))
    adapters = dict(bench.adapter_shapes(16))
    for name, (_, fan_in) in [(n, s) for n, s in adapters.items() if ".lora_A." in n]:
        base = full[name.replace(".lora_A.default", "")]
        fan_out = adapters[name.replace("lora_A", "lora_B")][0]
        assert (fan_out, fan_in) == base, name


def test_the_figures_become_a_bytes_row_and_a_seconds_row_per_engine() -> None:
    line = {
        "lora": {"rank": 16},
        "full_bytes": 10**9,
        "lora_bytes": 2 * 10**7,
        "transports": {
            "snapshot": {
                "full": {"seconds": 4.0},
                "lora_torch": {"seconds": 0.1},
                "lora_sglang": {"seconds": 0.4},
            }
        },
    }
    rows = report.rows_lora_sync(line)
    assert [(r.ours, r.ratio, r.met) for r in rows] == [
        ("20.0 MB (adapters)", "2.0%", "yes"),
        ("0.100 s", "0.025x", "-"),
        ("0.400 s", "0.100x", "-"),
    ]
