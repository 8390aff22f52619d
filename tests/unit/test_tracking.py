"""`job.tracking`: each backend writes what the trainer records (metrics, the job config,
sample tables) where its own reader finds it, a resumed trainer continues the same run, and a
missing package is a clear error. No test may reach a network (see `offline`)."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kuberl.common.config import ConfigError, JobConfig, parse_job_config
from kuberl.common.trajectory import Group, Trajectory
from kuberl.trainer.batch import Batch
from kuberl.trainer.batching import TrainingSequence
from kuberl.trainer.distributed import DistInfo
from kuberl.trainer.telemetry import Reporter
from kuberl.trainer.tracking import Runs, Tracking
from tests.tracking_readers import (
    OFFLINE_ENV,
    tensorboard_runs,
    tensorboard_scalars,
    tensorboard_texts,
    wandb_runs,
)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Offline env for the backends' own processes, and a socket guard in this one: a
    connection anywhere but loopback or a Unix socket fails the test."""
    for k, v in OFFLINE_ENV.items():
        monkeypatch.setenv(k, v)
    real_connect = socket.socket.connect

    def guarded(self: socket.socket, address: Any) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in (
            "127.0.0.1",
            "::1",
            "localhost",
        ):
            raise AssertionError(f"a tracker reached for the network: {address}")
        real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    yield


def decode(ids: Any) -> str:
    return " ".join(f"t{int(i)}" for i in ids)


def job(tmp_path: Path, *trackers: dict[str, Any]) -> JobConfig:
    return parse_job_config({"job": {"name": "track-test", "tracking": list(trackers)}}, env={})


def batch() -> Batch:
    samples = [
        TrainingSequence(
            prompt_ids=np.array([1, 2]),
            response_ids=np.array([3, 4, 5]),
            loss_mask=np.ones(3),
            reward=float(i),
        )
        for i in range(3)
    ]
    return Batch(samples=samples)


def eval_groups() -> list[Group]:
    def traj(i: int, reward: float) -> Trajectory:
        return Trajectory(
            prompt_token_ids=np.array([7, i]),
            response_token_ids=np.array([8]),
            rollout_logprobs=np.zeros(1, dtype=np.float32),
            reward=reward,
        )

    return [
        Group(prompt_id="gsm8k:0", epoch=0, trajectories=[traj(0, 1.0), traj(1, 0.0)]),
        Group(prompt_id="gsm8k:1", epoch=0, trajectories=[traj(2, 0.5)]),
    ]


def one_run(config: JobConfig, tmp_path: Path, resumed: bool, first: int) -> dict[str, str]:
    """Steps `first`, `first`+1 with a training table at each and an eval round at the last;
    the run ids it recorded."""
    tracking = Tracking.open(config, tmp_path, tmp_path / "ckpt", resumed, decode, first)
    for step in (first, first + 1):
        tracking.metrics({"loss/total": 0.5 * step, "tokens_per_second": 100.0}, step)
        tracking.train_samples(batch(), step)
    tracking.metrics({"eval/accuracy": 0.25, "eval/gsm8k/pass@n": 0.5}, first + 1)
    tracking.eval_samples(eval_groups(), first + 1)
    assert len(tracking.trackers) == len(config.job.tracking), "a tracker was dropped"
    tracking.close()
    return Runs.read(tmp_path / "ckpt").ids


def test_tracking_is_empty_by_default_and_each_backend_parses() -> None:
    assert parse_job_config({}, env={}).job.tracking == []
    config = parse_job_config(
        {
            "job": {
                "tracking": [
                    {"backend": "wandb", "project": "p"},
                    {"backend": "tensorboard", "dir": "tb"},
                    {"backend": "mlflow", "tracking_uri": "file:/tmp/m"},
                ]
            }
        },
        env={},
    )
    assert [t.backend for t in config.job.tracking] == ["wandb", "tensorboard", "mlflow"]


def test_an_unknown_backend_or_option_names_the_entry() -> None:
    with pytest.raises(ConfigError, match=r"job\.tracking\.0"):
        parse_job_config({"job": {"tracking": [{"backend": "neptune"}]}}, env={})
    with pytest.raises(ConfigError, match=r"job\.tracking\.0\.tensorboard\.project"):
        parse_job_config(
            {"job": {"tracking": [{"backend": "tensorboard", "project": "x"}]}}, env={}
        )


def test_tracking_is_set_from_the_environment_as_yaml() -> None:
    env = {"KUBERL_JOB__TRACKING": "[{backend: tensorboard, dir: tb}, {backend: mlflow}]"}
    config = parse_job_config({}, env=env)
    assert [t.backend for t in config.job.tracking] == ["tensorboard", "mlflow"]


def test_tensorboard_gets_metrics_config_and_sample_tables(tmp_path: Path) -> None:
    config = job(
        tmp_path, {"backend": "tensorboard", "dir": "tb", "samples": 2, "samples_every": 1}
    )
    one_run(config, tmp_path, resumed=False, first=1)
    (acc,) = tensorboard_runs(tmp_path / "tb").values()
    assert tensorboard_scalars(acc, "loss/total") == [(1, 0.5), (2, 1.0)]
    assert tensorboard_scalars(acc, "eval/accuracy") == [(2, 0.25)]
    (_, text), *_ = tensorboard_texts(acc, "config")
    assert '"name": "track-test"' in text
    train = tensorboard_texts(acc, "samples/train")
    assert [s for s, _ in train] == [1, 2]
    assert "| t1 t2 | t3 t4 t5 | 1 |" in train[0][1]
    assert "| t1 t2 | t3 t4 t5 | 2 |" not in train[0][1], "samples: 2 keeps two rows"
    ((_, evals),) = tensorboard_texts(acc, "samples/eval")
    assert "| t7 t0 | t8 | 1 |" in evals and "| t7 t2 | t8 | 0.5 |" in evals


def test_wandb_offline_gets_metrics_config_and_sample_tables(tmp_path: Path) -> None:
    config = job(tmp_path, {"backend": "wandb", "dir": "wb", "samples": 3, "samples_every": 2})
    ids = one_run(config, tmp_path, resumed=False, first=1)
    (run,) = wandb_runs(tmp_path / "wb").values()
    assert run.run_id == ids["0:wandb"]
    assert run.config["job"]["name"] == "track-test"
    losses = [(r["_step"], r["loss/total"]) for r in run.history if "loss/total" in r]
    assert losses == [(1, 0.5), (2, 1.0)]
    (row,) = run.rows_with_table("samples/train")
    assert row["_step"] == 2, "samples_every: 2"
    table = run.table(row, "samples/train")
    assert table["columns"] == ["prompt", "response", "reward"]
    assert table["data"][0] == ["t1 t2", "t3 t4 t5", 0.0] and len(table["data"]) == 3
    (eval_row,) = run.rows_with_table("samples/eval")
    assert eval_row["eval/accuracy"] == 0.25
    assert run.table(eval_row, "samples/eval")["data"][1] == ["t7 t2", "t8", 0.5]


def test_mlflow_file_store_gets_metrics_config_and_sample_tables(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"file:{tmp_path / 'mlruns'}"
    config = job(tmp_path, {"backend": "mlflow", "tracking_uri": uri, "samples_every": 1})
    ids = one_run(config, tmp_path, resumed=False, first=1)
    client = MlflowClient(tracking_uri=uri)
    run_id = ids["0:mlflow"]
    history = client.get_metric_history(run_id, "loss/total")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 1.0)]
    assert client.get_metric_history(run_id, "eval/gsm8k/pass_n")[0].value == 0.5
    assert client.get_run(run_id).data.params["job.name"] == "track-test"
    config_path = Path(client.download_artifacts(run_id, "config.json", str(tmp_path / "dl")))
    assert json.loads(config_path.read_text())["job"]["name"] == "track-test"
    table = Path(client.download_artifacts(run_id, "samples/eval/step_000002.json", str(tmp_path)))
    rows = json.loads(table.read_text())
    assert rows["columns"] == ["prompt", "response", "reward"]
    assert rows["data"][0] == ["t7 t0", "t8", 1.0]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_resumed_trainer_continues_every_run_at_its_step(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"file:{tmp_path / 'mlruns'}"
    config = job(
        tmp_path,
        {"backend": "wandb", "dir": "wb"},
        {"backend": "tensorboard", "dir": "tb"},
        {"backend": "mlflow", "tracking_uri": uri},
    )
    first = one_run(config, tmp_path, resumed=False, first=1)
    again = one_run(config, tmp_path, resumed=True, first=3)
    assert again == first, "the resumed trainer opened new runs"
    (tb,) = tensorboard_runs(tmp_path / "tb").values()
    assert [s for s, _ in tensorboard_scalars(tb, "loss/total")] == [1, 2, 3, 4]
    history = MlflowClient(tracking_uri=uri).get_metric_history(first["2:mlflow"], "loss/total")
    assert [m.step for m in history] == [1, 2, 3, 4]
    (run,) = wandb_runs(tmp_path / "wb").values()
    assert [r["_step"] for r in run.history if "loss/total" in r] == [1, 2, 3, 4]
    assert len(run.folders) == 2, "each start writes its own offline folder of the same run"


def test_rl_after_a_warm_up_run_elsewhere_continues_its_runs_after_its_steps(
    tmp_path: Path,
) -> None:
    # `kuberl run` trains the warm-up as its own trainer (checkpoints in `warm`); the RL
    # trainer, told where (KUBERL_TRACKING_WARM_UP), logs into the same runs. Each reports
    # through the Reporter: the warm-up's SFT steps go under sft/, and a restart of the RL
    # trainer (resumed from its own checkpoint folder) keeps the steps where they were.
    config = job(
        tmp_path, {"backend": "wandb", "dir": "wb"}, {"backend": "tensorboard", "dir": "tb"}
    )

    def trainer(kind: str, steps: range, runs_dir: str, **open_kw: Any) -> None:
        reporter = Reporter(DistInfo(0, 1, 0, torch.device("cpu")), total_steps=2)
        reporter.tracking = Tracking.open(
            config, tmp_path, tmp_path / runs_dir, decode=decode, step=steps[0] - 1, **open_kw
        )
        for step in steps:
            reporter.step({"loss/total": float(step)}, kind, step, version=step)
        reporter.close()

    trainer("sft", range(1, 4), "warm", resumed=False)
    trainer("rl", range(1, 2), "ckpt", resumed=False, warm_up=tmp_path / "warm")
    trainer("rl", range(2, 3), "ckpt", resumed=True, warm_up=tmp_path / "warm")
    tb, *more = tensorboard_runs(tmp_path / "tb").values()
    (run,) = wandb_runs(tmp_path / "wb").values()
    seen = {
        "tensorboard": (
            [s for s, _ in tensorboard_scalars(tb, "sft/loss/total")],
            [s for s, _ in tensorboard_scalars(tb, "loss/total")],
        ),
        "wandb": (
            [r["_step"] for r in run.history if "sft/loss/total" in r],
            [r["_step"] for r in run.history if "loss/total" in r],
        ),
    }
    assert (more, seen) == ([], {"tensorboard": ([1, 2, 3], [4, 5]), "wandb": ([1, 2, 3], [4, 5])})


def test_a_fresh_start_opens_new_runs_even_where_old_ids_are_recorded(tmp_path: Path) -> None:
    config = job(tmp_path, {"backend": "tensorboard", "dir": "tb"})
    first = one_run(config, tmp_path, resumed=False, first=1)
    second = one_run(config, tmp_path, resumed=False, first=1)
    assert first != second
    assert len(tensorboard_runs(tmp_path / "tb")) == 2


def test_a_missing_backend_package_names_the_entry_and_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    config = job(tmp_path, {"backend": "tensorboard", "dir": "tb"}, {"backend": "wandb"})
    with pytest.raises(RuntimeError, match=r"job\.tracking\[1\].*pip install 'kuberl\[tracking\]'"):
        Tracking.open(config, tmp_path, tmp_path / "ckpt", False, decode, 0)


def test_a_tracker_that_fails_mid_run_is_dropped_and_the_others_go_on(tmp_path: Path) -> None:
    config = job(
        tmp_path, {"backend": "tensorboard", "dir": "a"}, {"backend": "tensorboard", "dir": "b"}
    )
    tracking = Tracking.open(config, tmp_path, tmp_path / "ckpt", False, decode, 0)
    broken = tracking.trackers[0][1]

    def fail(*args: Any) -> None:
        raise OSError("disk full")

    broken.metrics = fail  # type: ignore[method-assign]
    tracking.metrics({"loss/total": 1.0}, 1)
    tracking.metrics({"loss/total": 2.0}, 2)
    assert broken not in [t for _, t in tracking.trackers]
    tracking.close()
    (b,) = tensorboard_runs(tmp_path / "b").values()
    assert tensorboard_scalars(b, "loss/total") == [(1, 1.0), (2, 2.0)]


def test_every_tracker_has_a_step_before_the_metrics_file_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A trainer killed between the two writes must not leave a step in metrics.jsonl (what
    # `kuberl run` and the tests watch) that a tracker never had: the restart resumes past it.
    from kuberl.trainer.telemetry import METRICS_JSONL_ENV
    from kuberl.trainer.tracking import Tracker

    metrics_file = tmp_path / "metrics.jsonl"
    monkeypatch.setenv(METRICS_JSONL_ENV, str(metrics_file))
    in_file_when_tracked: list[bool] = []

    class Probe(Tracker):
        run_id = "probe"

        def config(self, config: dict[str, Any], step: int) -> None: ...

        def metrics(self, values: dict[str, float], step: int) -> None:
            in_file_when_tracked.append(metrics_file.exists() and bool(metrics_file.read_text()))

        def samples(self, name: str, rows: Any, step: int) -> None: ...

        def close(self) -> None: ...

    config = job(tmp_path, {"backend": "tensorboard", "dir": "tb"})
    reporter = Reporter(DistInfo(0, 1, 0, torch.device("cpu")), total_steps=1)
    reporter.tracking = Tracking([(config.job.tracking[0], Probe())], decode)
    reporter.step({"loss/total": 1.0}, "rl", 1, version=1)
    assert in_file_when_tracked == [False]
    assert json.loads(metrics_file.read_text())["step"] == 1
