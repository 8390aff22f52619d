"""benchmarks/report.py (`make bench`): every benchmark has a reader, result lines become the
report's table, failures and unmeasured GPU figures are said, and a real benchmark run is
recorded with its last JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.benchmarks import load
from tests.support import REPO

report = load("report")
RUN = {
    "_run": {
        "command": "python benchmarks/x.py",
        "date": "2026-11-23 12:00 UTC",
        "seconds": 1.0,
        "load_start": 2.0,
        "load_end": 3.0,
        "machine": "box: 2-core x86_64 CPU, no GPU",
    }
}
# One result line per benchmark, in the shapes the scripts print (trimmed to what is read).
LINES: dict[str, dict[str, Any]] = {
    "activation_checkpointing": {
        "model": "qwen2-0.5b in miniature",
        "seq_len": 2048,
        "modes": {
            "none": {"activation_mib": 496.9, "seconds": 3.17, "memory_vs_none": 1.0},
            "selective": {
                "activation_mib": 272.8,
                "seconds": 3.22,
                "memory_vs_none": 0.549,
                "time_vs_none": 1.017,
            },
        },
    },
    "response_head": {
        "model": "qwen2-0.5b in miniature",
        "device": "cpu",
        "dtype": "float32",
        "shares": {
            "0.25": {
                "prompt_tokens": 256,
                "response_tokens": 768,
                "response_only_seconds": 1.25,
                "every_position_seconds": 1.361,
                "speedup": 1.089,
            }
        },
    },
    "put_encoding": {
        "request_bytes": 1219219,
        "by_group_ms_per_request": 0.092,
        "one_piece_ms_per_request": 2.231,
        "speedup": 24.33,
        "by_group_page_faults_per_request": 2.8,
        "one_piece_page_faults_per_request": 1127.0,
    },
    "buffer_throughput": {
        "service_traj_per_s": 812.4,
        "raw_redis_traj_per_s": 1650.0,
        "ratio_service_to_raw": 0.492,
        "goal": {"traj_per_s": 2500, "ratio": 0.5},
        "goal_met": False,
    },
    "gae": {
        "batch": 64,
        "cpu": {
            "copy_bandwidth_gb_s": 5.0,
            "T=32768": {
                "ours_ms": 20.5,
                "verl_loop_ms": 7300.0,
                "speedup_vs_verl_loop": 356.1,
                "ours_over_bound": 3.1,
            },
        },
        "gpu": "skipped: no CUDA device",
    },
    "reward_throughput": {
        "gsm8k": {
            "direct_samples_per_s": 9000.0,
            "service_samples_per_s": 4500.0,
            "service_over_direct": 0.5,
        },
        "code": {
            "direct_samples_per_s": 20.0,
            "service_samples_per_s": 18.0,
            "service_over_direct": 0.9,
        },
    },
    "rollout_engine": {
        "model": {"size": "small"},
        "new_tokens": 64,
        "results": [
            {
                "device": "cpu",
                "batch": 8,
                "engine_tokens_per_s": 900.0,
                "generate_tokens_per_s": 600.0,
                "ratio_engine_over_generate": 1.5,
            }
        ],
    },
    "trainer_logprobs": {
        "tokens": 2048,
        "vocab": 65536,
        "device": "cpu",
        "chunked_seconds": 2.0,
        "full_seconds": 1.0,
        "time_ratio_chunked_over_full": 2.0,
        "chunked_peak_bytes": 64 * 2**20,
        "full_peak_bytes": 1024 * 2**20,
        "memory_ratio_chunked_over_full": 0.0625,
    },
    "weight_sync": {
        "payload_gb": 1.0,
        "baseline_raw_gloo_broadcast_pair": {"seconds": 1.0},
        "relay": {"shm": {"4": {"seconds": 1.2, "ratio_vs_raw_pair": 1.2}}},
        "gpu": "skipped",
    },
    "lora_sync": {
        "model": "Qwen2-0.5B shapes, bf16, random values",
        "lora": {"rank": 16},
        "full_bytes": 1000 * 10**6,
        "lora_bytes": 18 * 10**6,
        "transports": {
            "shm": {
                "full": {"seconds": 1.0},
                "lora_torch": {"seconds": 0.02},
                "lora_sglang": {"seconds": 0.2},
            }
        },
    },
    "vs_trl": {
        "trl": {
            "wall_seconds": 90.0,
            "samples": 25600,
            "samples_per_second": 284.4,
            "cpu_seconds": 95.0,
            "final_accuracy": 0.9,
            "accuracy_at_equal_wall_time": 0.9,
        },
        "kuberl": {
            "wall_seconds": 140.0,
            "samples": 25600,
            "samples_per_second": 182.9,
            "cpu_seconds": 200.0,
            "final_accuracy": 0.88,
            "accuracy_at_equal_wall_time": 0.87,
        },
        "equal_wall_time_seconds": 90.0,
        "kuberl_seconds_to_trl_final_accuracy": None,
        "ratio_kuberl_time_to_trl_final_over_trl_wall": None,
        "ratio_wall_kuberl_over_trl": 1.556,
        "ratio_samples_per_second_kuberl_over_trl": 0.643,
        "ratio_cpu_seconds_kuberl_over_trl": 2.105,
        "goal_met": False,
        "learning_per_sample": {
            "second_half_accuracy": {"trl": [0.9, 0.92], "kuberl": [0.89, 0.91]},
            "second_half_difference": -0.01,
            "second_half_difference_stderr": 0.004,
            "eval_noise": 0.029,
        },
    },
    "trainer_mfu": {"skipped": True, "reason": "no CUDA device"},
    "scale": {
        "runs": [
            {
                "replicas": 4,
                "lease_ms": {"p50": 3.0, "p99": 5.0},
                "put_ms": {"p50": 8.0, "p99": 10.0},
                "cpu_ms_per_1k_traj": {"buffer_plus_redis": 800.0},
            },
            {
                "replicas": 256,
                "lease_ms": {"p50": 20.0, "p99": 40.0},
                "put_ms": {"p50": 30.0, "p99": 60.0},
                "cpu_ms_per_1k_traj": {"buffer_plus_redis": 600.0},
            },
        ],
        "fan_out": {
            "star": {"4": {"seconds": 1.0}, "64": {"seconds": 9.0}},
            "relay": {"4": {"seconds": 1.0}, "64": {"seconds": 2.5}},
        },
        "buffers_at_largest": {"one": {"traj_per_s": 500.0}, "two": {"traj_per_s": 600.0}},
        "summary": {
            "cpu_per_1k_ratio_largest_to_smallest": 0.75,
            "fan_out_ratio_64_to_4": 2.5,
            "two_buffers_ratio": 1.2,
            "goals_met": {
                "p99_ms": False,
                "cpu_ratio": True,
                "fan_out_ratio": True,
                "two_buffers": False,
            },
        },
    },
}
MFU_ON_H100 = {
    "benchmark": "trainer_mfu",
    "stock": {"tokens_per_second": 60000.0, "mfu": 0.196, "peak_memory_gib": 50.0},
    "kuberl": {"tokens_per_second": 90000.0, "mfu": 0.294, "peak_memory_gib": 20.0},
    "sequence_tokens": 2048,
    "ratio_tokens_per_second_kuberl_over_stock": 1.5,
    "goal_met": False,
    "_run": {**RUN["_run"], "machine": "gpu-box: 16-core x86_64 CPU, NVIDIA H100 80GB HBM3"},
}


def _results() -> dict[str, dict[str, Any]]:
    return {name: {"benchmark": name, **line, **RUN} for name, line in LINES.items()}


def test_every_benchmark_make_bench_runs_exists_and_has_a_reader() -> None:
    scripts = {report.SCRIPTS.get(n, n) for n in report.BENCHMARKS}
    missing = [n for n in scripts if not (REPO / "benchmarks" / f"{n}.py").exists()]
    assert (missing, set(report.ROWS)) == ([], set(report.BENCHMARKS))


def test_every_benchmark_script_under_benchmarks_is_run_by_make_bench() -> None:
    scripts = {p.stem for p in (REPO / "benchmarks").glob("*.py")} - {"report"}
    assert scripts == {report.SCRIPTS.get(n, n) for n in report.BENCHMARKS}


def test_result_lines_become_table_rows_with_goal_and_verdict() -> None:
    text = report.render(_results(), {}, note="shared box")
    expected = (
        "| buffer: trajectories/s through one replica (2,048-token responses) | 812 traj/s "
        "| 1,650 traj/s (raw Redis streams) | 0.49x | >= 2,500 traj/s and >= 0.5x | **no** "
        "| box: 2-core x86_64 CPU, no GPU, load 2.0-3.0 | 2026-11-23 12:00 UTC |"
    )
    assert expected in text.splitlines()


def test_the_scale_rows_compare_the_largest_n_to_the_smallest_and_relay_to_star() -> None:
    rows = [
        line for line in report.render(_results(), {}, note="").splitlines() if "scale:" in line
    ]
    cells = [row.split(" | ")[1:6] for row in rows]
    assert cells == [
        ["40.0 / 60.0 ms", "5.0 / 10.0 ms at 4", "6.00x", "<= 50 ms", "**no**"],
        ["600 ms", "800 ms at 4", "0.75x", "<= 1.5x", "yes"],
        ["2.50 s", "1.00 s to 4; star 9.00 s to 64", "2.50x", "<= 3x", "yes"],
        ["600 traj/s", "500 traj/s (one replica)", "1.20x",
         ">= 1.7x (or the bound named in docs/scale.md)", "**no**"],
    ]  # fmt: skip


def test_the_trl_headline_row_says_not_reached_when_kuberl_never_got_there() -> None:
    text = report.render(_results(), {}, note="")
    row = next(line for line in text.splitlines() if "time to TRL's final" in line)
    assert row.split(" | ")[1:6] == [
        "not reached",
        "90 s (TRL GRPOTrainer, 1 torch thread)",  # lines from before TRL said its threads
        "n/a",
        "<= 0.7x",
        "**no**",
    ]


def test_the_trl_rows_compare_both_sides_after_the_same_samples_trained() -> None:
    text = report.render(_results(), {}, note="")
    row = next(line for line in text.splitlines() if "second half of training" in line)
    assert "mean of 2 pairs; one evaluation scatters by 0.029" in row
    assert row.split(" | ")[1:4] == ["0.900", "0.910 (TRL)", "-0.010 ± 0.004"]


def test_a_failed_benchmark_is_listed_with_its_error() -> None:
    results = _results()
    results["gae"] = {"benchmark": "gae", "error": "exit 1: boom", **RUN}
    text = report.render(results, {}, note="")
    assert ("- `gae` failed: `exit 1: boom`" in text, "GAE B=64" in text) == (True, False)


def test_gpu_figures_are_listed_unmeasured_until_a_gpu_run_is_merged() -> None:
    before = report.render(_results(), {}, note="")
    after = report.render(_results(), {"trainer_mfu": MFU_ON_H100}, note="")
    mfu_row = next(line for line in after.splitlines() if line.startswith("| trainer MFU"))
    assert (
        "- `trainer_mfu`:" in before,
        "- `trainer_mfu`:" in after,
        mfu_row.split(" | ")[1:6],
        "NVIDIA H100" in mfu_row,
    ) == (
        True,
        False,
        ["29.4% (defaults)", "19.6% (stock DeepSpeed ZeRO-2)", "1.50x", ">= 40%", "**no**"],
        True,
    )


def test_a_benchmark_run_is_recorded_with_its_last_json_line(tmp_path: Path) -> None:
    results, out = tmp_path / "results.jsonl", tmp_path / "report.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "report.py"),
            "--only",
            "trainer_mfu",
            "--results",
            str(results),
            "--gpu-results",
            str(tmp_path / "none.jsonl"),
            "--out",
            str(out),
            "--logs",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=240,
    )
    line = json.loads(results.read_text())
    skipped = not torch.cuda.is_available()
    assert (
        proc.returncode,
        line["benchmark"],
        line.get("skipped", False),
        line["_run"]["command"],
        "## GPU figures" in out.read_text(),
    ) == (0, "trainer_mfu", skipped, "python benchmarks/trainer_mfu.py", True)


def test_regenerating_the_report_keeps_the_hand_written_notes(tmp_path: Path) -> None:
    results, out = tmp_path / "results.jsonl", tmp_path / "report.md"
    results.write_text(json.dumps(_results()["buffer_throughput"]) + "\n")
    out.write_text(
        "# old table\n\n**Conditions:** idle VM, code of abc123\n\n"
        f"{report.NOTES_MARKER}\n## Where the time goes\nprofile\n"
    )
    args = ["--no-run", "--results", str(results), "--gpu-results", str(tmp_path / "g")]
    report.main([*args, "--out", str(out)])
    text = out.read_text()
    assert (
        "# old table" in text,
        "| buffer: trajectories/s" in text,
        text.endswith(f"{report.NOTES_MARKER}\n## Where the time goes\nprofile\n"),
        "**Conditions:** idle VM, code of abc123" in text,  # the rows' run is still described
    ) == (False, True, True, True)
    report.main([*args, "--out", str(out), "--note", "a new note"])
    text = out.read_text()
    assert ("abc123" in text, "**Conditions:** a new note" in text) == (False, True)


def test_a_gpu_checks_run_is_merged_with_its_commands_device_and_mfu_variants(
    tmp_path: Path,
) -> None:
    # What benchmarks/gpu_checks.sh leaves in $OUT: env.log, then each step's header and output.
    run = tmp_path / "out"
    run.mkdir()
    (run / "env.log").write_text(
        "2026-11-26 10:30 UTC\nname, memory.total [MiB]\nNVIDIA H100 80GB HBM3, 81559 MiB\n"
        "checkout 0f1b540 bench: one script\n"
        "torch 2.11.0+cu130 cuda 13.0 NVIDIA H100 80GB HBM3\n"
    )
    mfu = {"benchmark": "trainer_mfu", "date": "2026-11-26 10:31 UTC", "sequence_tokens": 2048}
    both = {**mfu, "stock": {"mfu": 0.2}, "kuberl": {"mfu": 0.1}, "kuberl_micro_batch_sequences": 8}
    variant = {**mfu, "kuberl": {"mfu": 0.3}, "compile_logprobs": True}
    # Two more runs of both variants: the better kuberl one is the table's, a failed one never.
    measured = {"tokens_per_second": 45_000, "peak_memory_gib": 30.0}
    better = {**both, "kuberl": {"mfu": 0.15, **measured}, "compile_model": True}
    better["logprob_chunk_size"] = 16384
    worse = {**both, "kuberl": {"mfu": 0.12}}
    failed = {**both, "kuberl": {"error": "CUDA out of memory"}}
    (run / "mfu.log").write_text(
        "== python3 benchmarks/trainer_mfu.py --steps 3 (limit 150s)\nnoise\n"
        + json.dumps(both)
        + "\n== python3 benchmarks/trainer_mfu.py --variants kuberl --compile-logprobs "
        "(limit 120s)\n" + json.dumps(variant) + "\n"
        "== python3 benchmarks/trainer_mfu.py --compile-model (limit 150s)\n"
        + "\n".join(json.dumps(x) for x in (better, worse, failed))
        + "\n"
    )
    (run / "bench.log").write_text(
        "== python3 benchmarks/gae.py (limit 60s)\n"
        + json.dumps({"benchmark": "gae", "gpu": {"T=1024": {}}})
        + "\n{not json\n"
        + json.dumps({"benchmark": "rollout_engine", "skipped": True})
        + "\n"
    )
    gpu_results, mfu_runs = tmp_path / "gpu.jsonl", tmp_path / "mfu.jsonl"
    gpu_results.write_text(json.dumps({"benchmark": "gae", "old": True}) + "\n")
    merged = report.merge_gpu_run(run, gpu_results, mfu_runs)
    results = report.read_results(gpu_results)
    runs = [json.loads(x) for x in mfu_runs.read_text().splitlines()]
    # The variant (kuberl only) goes to the runs file, not the table; skipped lines nowhere.
    assert (merged, sorted(results), results["trainer_mfu"]["kuberl"]) == (
        ["gae", "trainer_mfu"],
        ["gae", "trainer_mfu"],
        {"mfu": 0.15, **measured},
    )
    assert [r.get("compile_logprobs", False) for r in runs] == [False, True, False, False, False]
    row = report.rows_trainer_mfu(results["trainer_mfu"])[0]
    assert row.ours == "15.0% (micro-batch 8 x 2,048, chunk 16,384, compiled layers)"
    assert results["gae"]["_run"] == {
        "name": "gae",
        "command": "python3 benchmarks/gae.py",
        "date": "2026-11-26 10:30 UTC",
        "machine": "device: NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, checkout 0f1b540",
    }
    assert runs[1]["_run"]["command"].endswith("--variants kuberl --compile-logprobs")
    assert runs[1]["_run"]["date"] == "2026-11-26 10:31 UTC"


def test_the_long_task_rows_name_the_response_length_generation_share_and_its_goal() -> None:
    line = json.loads(json.dumps(LINES["vs_trl"]))
    line["trl"].update(
        generation_share_of_training_loop=0.64, mean_completion_tokens=97.2, torch_threads=2
    )
    line.update(
        task="long",
        kuberl_seconds_to_trl_final_accuracy=45.0,
        ratio_kuberl_time_to_trl_final_over_trl_wall=0.5,
        goal="kuberl reaches TRL's final accuracy in <= 0.6x TRL's wall time",
        goal_met=True,
    )
    results = {"vs_trl_long": {"benchmark": "vs_trl_long", **line, **RUN}}
    rows = [r for r in report.render(results, {}, note="").splitlines() if "long-response" in r]
    assert rows[0].split(" | ")[:6] == [
        "| long-response GRPO (97-token responses, generation 64% of TRL's loop): time to "
        "TRL's final greedy held-out accuracy (0.900)",
        "45 s",
        "90 s (TRL GRPOTrainer, 2 torch threads)",
        "0.50x",
        "<= 0.6x",
        "yes",
    ]
    assert all(r.startswith("| long-response GRPO (") for r in rows) and len(rows) == 7


def test_the_staleness_rows_name_the_long_task_and_hold_it_to_no_demo_goal() -> None:
    staleness = load("staleness")
    row = {
        "settings": {"task": "demo"},
        "wall_seconds": 100.0,
        "staleness_max": 0.0,
        "machine": "t",
    }
    lines = [
        {**row, "arm": "s0", "seed": s, "final_accuracy": 0.95, "second_half_accuracy": 0.94}
        for s in (0, 1)
    ]
    lines += [
        {**row, "arm": "s1", "seed": s, "final_accuracy": f, "second_half_accuracy": 0.9}
        for s, f in ((0, 0.90), (1, 0.92))
    ]
    long = [{**r, "settings": {"task": "long"}} for r in lines]
    results = {}
    for rows in (lines, long):
        summary = staleness.summarize(rows)
        results[summary["benchmark"]] = {**summary, **RUN}
    assert set(results) == {"staleness", "staleness_long"}
    table = [r for r in report.render(results, {}, note="").splitlines() if "staleness" in r]
    cells = [r.split(" | ")[:6] for r in table]
    # s1 - s0 by seed: -0.05, -0.03: mean -0.040, stderr 0.010
    assert cells == [
        [
            f"| staleness{task}: final held-out accuracy at equal samples, s1 (2 seeded pairs)",
            "0.910 (median)",
            "0.950 (on-policy, s0)",
            "-0.040 ± 0.010 (paired difference)",
            goal,
            met,
        ]
        for task, goal, met in (
            ("", "within ±0.005", "**no**"),
            (" (long-response task)", "-", "-"),
        )
    ]


def test_run_one_makes_its_log_folder_and_records_a_failed_run(tmp_path: Path) -> None:
    logs = tmp_path / "not-yet" / "logs"
    # `report.py --help` prints usage, not a JSON line: a failed run, recorded, not a crash.
    result = report.run_one("report", ["--help"], 120, logs)
    assert "error" in result and result["_run"]["command"] == "python benchmarks/report.py --help"
    assert "usage" in (logs / "report.log").read_text()
