"""`job.tracking` through `kuberl run`: a short RL job with W&B (offline), TensorBoard and MLflow
(file store) must leave, in each, the trainer's step and eval metrics, the job config and sample
tables; its trainer, killed mid-run and restarted by the supervisor from its checkpoint, must
continue the same tracked runs at the step it resumed from, and so must a run stopped with
Ctrl-C and gone on with by `kuberl run --resume`; a run with an SFT warm start is one tracked run
too. No network (`OFFLINE_ENV`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO, short_demo_job
from tests.tracking_readers import (
    OFFLINE_ENV,
    tensorboard_runs,
    tensorboard_scalars,
    tensorboard_texts,
    wandb_runs,
)

TOTAL_STEPS = 6


def _short_job(tmp: Path) -> Path:
    """examples/demo.yaml without its warm start, a checkpoint every step."""
    return short_demo_job(
        tmp, "tracking-e2e", eval_prompts=4, total_steps=TOTAL_STEPS, checkpoint_every=1
    )


def _trainer_pid(run_dir: Path) -> int | None:
    """The live `kuberl serve trainer` process of this run."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "serve trainer" in cmdline and str(run_dir) in cmdline:
            return int(entry.name)
    return None


def _rl_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if r.get("kind") == "rl"]


def _env(
    tmp: Path, backends: tuple[str, ...] = ("wandb", "tensorboard", "mlflow")
) -> dict[str, str]:
    tracking = [
        {"backend": "wandb", "dir": str(tmp / "wb"), "samples_every": 1},
        {"backend": "tensorboard", "dir": str(tmp / "tb"), "samples_every": 1},
        {"backend": "mlflow", "tracking_uri": f"file:{tmp / 'mlruns'}", "samples_every": 1},
    ]
    tracking = [t for t in tracking if t["backend"] in backends]
    return {
        **os.environ,
        **OFFLINE_ENV,
        "PYTHONUNBUFFERED": "1",
        "KUBERL_JOB__TRACKING": json.dumps(tracking),
        # W&B writes its offline log every 15 s by default: a SIGKILL would take the first
        # start's last 15 s with it, here all of it.
        "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL": "0.5",
    }


def _kuberl_run(tmp: Path, *args: str, **env_kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kuberl.cli", "run", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(tmp, **env_kw),
    )


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tracking-run")
    run_dir = tmp / "run"
    proc = _kuberl_run(tmp, str(_short_job(tmp)), "--run-dir", str(run_dir))
    killed_after: int | None = None
    deadline = time.monotonic() + 400
    while proc.poll() is None and time.monotonic() < deadline and killed_after is None:
        steps = _rl_steps(run_dir)
        pid = _trainer_pid(run_dir)
        if steps and steps[-1] >= 2 and pid is not None:
            killed_after = steps[-1]
            os.kill(pid, signal.SIGKILL)  # the supervisor restarts it from its checkpoint
        time.sleep(0.1)
    output, _ = proc.communicate(timeout=500)
    return {
        "code": proc.returncode,
        "output": output,
        "tmp": tmp,
        "killed_after": killed_after,
        "steps": _rl_steps(run_dir),
    }


def test_the_run_finished_after_its_trainer_was_killed_and_restarted(
    tracked_run: dict[str, Any],
) -> None:
    assert tracked_run["code"] == 0, tracked_run["output"][-3000:]
    assert tracked_run["killed_after"] is not None and tracked_run["killed_after"] < TOTAL_STEPS
    assert tracked_run["steps"][-1] == TOTAL_STEPS


def test_tensorboard_has_one_run_with_every_step_metrics_config_and_samples(
    tracked_run: dict[str, Any],
) -> None:
    runs = tensorboard_runs(tracked_run["tmp"] / "tb")
    assert len(runs) == 1, f"the restarted trainer wrote elsewhere: {list(runs)}"
    (acc,) = runs.values()
    steps = [s for s, _ in tensorboard_scalars(acc, "loss/total")]
    assert sorted(set(steps)) == list(range(1, TOTAL_STEPS + 1)), steps
    assert tensorboard_scalars(acc, "tokens_per_second")
    assert {s for s, _ in tensorboard_scalars(acc, "eval/accuracy")} == {0, TOTAL_STEPS}
    assert len(tensorboard_texts(acc, "config")) == 2, "one config per start"
    assert tensorboard_texts(acc, "samples/train") and tensorboard_texts(acc, "samples/eval")


def test_wandb_has_one_run_id_over_both_starts_with_metrics_config_and_samples(
    tracked_run: dict[str, Any],
) -> None:
    runs = wandb_runs(tracked_run["tmp"] / "wb")
    assert len(runs) == 1, f"the restarted trainer opened another run: {list(runs)}"
    (run,) = runs.values()
    assert len(run.folders) == 2, "both starts wrote into the same run id"
    assert run.config["job"]["name"] == "tracking-e2e"
    steps = [r["_step"] for r in run.history if "loss/total" in r]
    killed_after = tracked_run["killed_after"]
    # (What the first start logged in its last flush interval dies with its SIGKILL: W&B's
    # own loss, which test_tracking.py's graceful resume does not have.)
    assert set(steps) >= set(range(killed_after + 1, TOTAL_STEPS + 1)), steps
    assert any("eval/accuracy" in r for r in run.history)
    (row, *_) = run.rows_with_table("samples/eval")
    table = run.table(row, "samples/eval")
    assert table["columns"] == ["prompt", "response", "reward"] and table["data"]
    assert "+" in table["data"][0][0], "the prompt is decoded text (Q: a+b=)"
    assert run.rows_with_table("samples/train")


def test_mlflow_has_one_run_with_every_step_metrics_config_and_samples(
    tracked_run: dict[str, Any],
) -> None:
    from mlflow.tracking import MlflowClient

    tmp = tracked_run["tmp"]
    os.environ.update(MLFLOW_ALLOW_FILE_STORE="true")
    client = MlflowClient(tracking_uri=f"file:{tmp / 'mlruns'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "kuberl"]
    (run,) = client.search_runs([experiment.experiment_id])
    run_id = run.info.run_id
    steps = [m.step for m in client.get_metric_history(run_id, "loss/total")]
    assert sorted(set(steps)) == list(range(1, TOTAL_STEPS + 1)), steps
    assert client.get_metric_history(run_id, "eval/accuracy")
    assert run.data.params["job.name"] == "tracking-e2e"
    artifacts = {a.path for a in client.list_artifacts(run_id, "samples/eval")}
    assert artifacts, "no eval sample tables"
    assert run.info.status == "FINISHED"


@pytest.mark.slow
def test_kuberl_run_resume_continues_every_tracked_run(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    first = _kuberl_run(tmp_path, str(_short_job(tmp_path)), "--run-dir", str(run_dir))
    try:
        deadline = time.monotonic() + 300
        while first.poll() is None and time.monotonic() < deadline and len(_rl_steps(run_dir)) < 2:
            time.sleep(0.1)
        first.send_signal(signal.SIGINT)
        out, _ = first.communicate(timeout=150)
    finally:
        if first.poll() is None:
            first.kill()
    stopped_at = max(_rl_steps(run_dir))
    assert first.returncode == 130 and stopped_at < TOTAL_STEPS, out[-3000:]
    second = _kuberl_run(tmp_path, "--resume", str(run_dir))
    out, _ = second.communicate(timeout=400)
    assert second.returncode == 0, out[-3000:]

    every_step = list(range(1, TOTAL_STEPS + 1))
    (wb,) = wandb_runs(tmp_path / "wb").values()  # a graceful stop flushed all of the first
    assert len(wb.folders) == 2
    assert sorted({r["_step"] for r in wb.history if "loss/total" in r}) == every_step
    (tb,) = tensorboard_runs(tmp_path / "tb").values()
    assert sorted({s for s, _ in tensorboard_scalars(tb, "loss/total")}) == every_step
    os.environ.update(MLFLOW_ALLOW_FILE_STORE="true")
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "kuberl"]
    (run,) = client.search_runs([experiment.experiment_id])
    steps = {m.step for m in client.get_metric_history(run.info.run_id, "loss/total")}
    assert sorted(steps) == every_step


@pytest.mark.slow
def test_a_warm_start_and_rl_are_one_tracked_run_the_warm_ups_steps_first(
    tmp_path: Path,
) -> None:
    # `kuberl run` trains the warm start as a trainer of its own before the services start;
    # its steps (under sft/) and then RL's must be one run in each tracker, on one x-axis.
    warm, rl = 3, 2
    job = short_demo_job(
        tmp_path,
        "tracking-warm",
        eval_prompts=4,
        total_steps=rl,
        checkpoint_every=0,
        sft_steps=warm,
        sft_batch_size=8,
    )
    proc = _kuberl_run(
        tmp_path, str(job), "--run-dir", str(tmp_path / "run"), backends=("wandb", "tensorboard")
    )
    out, _ = proc.communicate(timeout=500)
    assert proc.returncode == 0, out[-3000:]
    tb_runs = list(tensorboard_runs(tmp_path / "tb").values())
    wb_runs = list(wandb_runs(tmp_path / "wb").values())
    steps = {
        "tensorboard": [
            sorted({s for s, _ in tensorboard_scalars(tb, tag)})
            for tb in tb_runs
            for tag in ("sft/loss/sft", "loss/total")
            if tag in tb.Tags()["scalars"]
        ],
        "wandb": [
            sorted({r["_step"] for r in wb.history if key in r})
            for wb in wb_runs
            for key in ("sft/loss/sft", "loss/total")
            if any(key in r for r in wb.history)
        ],
    }
    one_run = [list(range(1, warm + 1)), list(range(warm + 1, warm + rl + 1))]
    assert steps == {"tensorboard": one_run, "wandb": one_run}, out[-2000:]
