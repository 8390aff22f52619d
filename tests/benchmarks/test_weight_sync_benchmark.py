"""benchmarks/weight_sync.py without running it (the timed runs need an idle machine): its payload
is the size the issue asks for, and its GPU figures are in the shape benchmarks/report.py reads
(checked here without a GPU, since no GPU run has produced them yet)."""

from __future__ import annotations

import torch

from tests.benchmarks import load

bench = load("weight_sync")
report = load("report")


def test_the_default_payload_is_qwen2_5_0_5b_sized_about_one_gb_of_bf16() -> None:
    shapes = bench.qwen05b_shapes(1.0)
    params = sum(torch.Size(s).numel() for _, s in shapes)
    assert (round(params / 1e6), round(2 * params / 1e9, 2)) == (496, 0.99)


def test_the_gpu_part_s_figures_become_the_report_s_cuda_ipc_row() -> None:
    line = {"gpu": bench.gpu_summary("H100", 2 * 10**9, 0.01, 0.015, 0.03)}
    rows = report.rows_weight_sync_gpu(line)
    assert [(r.ours, r.baseline, r.ratio, r.goal, r.met) for r in rows] == [
        ("0.015 s", "0.010 s (device-to-device copy)", "1.50x", "<= 2x", "yes")
    ]
