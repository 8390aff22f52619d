"""Experiment trackers (`job.tracking`): rank 0's `Reporter` fans every recorded metric, the job
config and tables of generated samples out to W&B, TensorBoard and MLflow, one `Tracker` per
entry, each imported only when configured. A tracked run's id is kept in the checkpoint folder
(`tracking-runs.json`), so a trainer resumed from its checkpoints continues the same run at
the step it had reached; an RL trainer after a warm-up run as its own trainer (`kuberl run`
names the warm-up's checkpoint folder in `KUBERL_TRACKING_WARM_UP`) continues the warm-up's
runs, its steps counted after the warm-up's. A tracker that fails mid-run is logged and
dropped, never the job.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from kuberl.common.config import (
    JobConfig,
    MlflowTracking,
    TensorBoardTracking,
    TrackerConfig,
    WandbTracking,
)
from kuberl.common.files import write_atomic
from kuberl.common.logs import get_logger
from kuberl.common.trajectory import Group
from kuberl.trainer.batch import Batch

log = get_logger(__name__)

RUNS_FILE = "tracking-runs.json"
WARM_UP_ENV = "KUBERL_TRACKING_WARM_UP"
SAMPLE_COLUMNS = ("prompt", "response", "reward")


@dataclass
class Runs:
    """`tracking-runs.json`: each tracker's run id (by `<index>:<backend>`), what this trainer
    adds to its steps (a warm-up's steps run by another trainer) and the last step logged."""

    ids: dict[str, str]
    offset: int = 0
    last_step: int = 0

    @classmethod
    def read(cls, folder: Path | None) -> Runs:
        path = folder / RUNS_FILE if folder is not None else None
        if path is None or not path.exists():
            return cls({})
        data = json.loads(path.read_text())
        if "ids" not in data:  # written before offsets: the ids alone
            return cls(data)
        return cls(data["ids"], int(data["offset"]), int(data["last_step"]))

    def write(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / RUNS_FILE, json.dumps(asdict(self)))


def warm_up_folder() -> Path | None:
    """The checkpoint folder of the warm-up run before this trainer, if `kuberl run` named one."""
    folder = os.environ.get(WARM_UP_ENV)
    return Path(folder) if folder else None


@dataclass
class SampleRow:
    """One row of a sample table: a generated sample, decoded."""

    prompt: str
    response: str
    reward: float


def backend_module(name: str, field: str, backend: str) -> ModuleType:
    """Import a backend's package, or say which entry needs it and how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise RuntimeError(
            f"{field} (backend {backend}) needs the `{name.split('.')[0]}` package, which is "
            f"not installed ({exc}): pip install 'kuberl[tracking]'"
        ) from exc


class Tracker(ABC):
    """One backend's run. `run_id` is what a resumed trainer passes back to continue it."""

    run_id: str

    @abstractmethod
    def config(self, config: dict[str, Any], step: int) -> None: ...

    @abstractmethod
    def metrics(self, values: dict[str, float], step: int) -> None: ...

    @abstractmethod
    def samples(self, name: str, rows: Sequence[SampleRow], step: int) -> None:
        """A table of samples under `samples/<name>` (train, eval)."""

    @abstractmethod
    def close(self) -> None: ...


class TensorBoardTracker(Tracker):
    """Scalars and text (the config and sample tables as markdown) in `<dir>/<name>-<id>`."""

    def __init__(
        self, cfg: TensorBoardTracking, field: str, base: Path, name: str, run_id: str | None
    ):
        backend_module("tensorboard", field, cfg.backend)
        from torch.utils.tensorboard import SummaryWriter

        self.run_id = run_id or f"{name}-{uuid.uuid4().hex[:8]}"
        self.logdir = _under(base, cfg.dir) / self.run_id
        self.writer = SummaryWriter(log_dir=str(self.logdir))

    def config(self, config: dict[str, Any], step: int) -> None:
        text = json.dumps(config, indent=2)
        self.writer.add_text("config", "```\n" + text + "\n```", step)

    def metrics(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def samples(self, name: str, rows: Sequence[SampleRow], step: int) -> None:
        def cell(text: str) -> str:
            return text.replace("|", "\\|").replace("\n", "<br>")

        lines = ["| prompt | response | reward |", "|---|---|---|"]
        lines += [f"| {cell(r.prompt)} | {cell(r.response)} | {r.reward:g} |" for r in rows]
        self.writer.add_text(f"samples/{name}", "\n".join(lines), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A W&B run; resumed by id (`resume="allow"`)."""

    def __init__(self, cfg: WandbTracking, field: str, base: Path, name: str, run_id: str | None):
        self.wandb: Any = backend_module("wandb", field, cfg.backend)
        self.run_id = run_id or uuid.uuid4().hex[:12]
        folder = _under(base, cfg.dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=name,
            dir=str(folder),
            id=self.run_id,
            resume="allow",
            mode=cfg.mode or os.environ.get("WANDB_MODE") or "online",
            tags=cfg.tags or None,
            reinit="create_new",
        )

    def config(self, config: dict[str, Any], step: int) -> None:
        self.run.config.update(config, allow_val_change=True)

    def metrics(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def samples(self, name: str, rows: Sequence[SampleRow], step: int) -> None:
        table = self.wandb.Table(
            columns=list(SAMPLE_COLUMNS), data=[[r.prompt, r.response, r.reward] for r in rows]
        )
        self.run.log({f"samples/{name}": table}, step=step)

    def close(self) -> None:
        self.run.finish()
        # wandb-core may hold the run's log file buffered until its service stops.
        self.wandb.teardown()


class MlflowTracker(Tracker):
    """An MLflow run through `MlflowClient` (no global active run); the config is the run's
    params and a `config.json` artifact, each sample table a `samples/<name>/step_N.json`."""

    def __init__(self, cfg: MlflowTracking, field: str, base: Path, name: str, run_id: str | None):
        backend_module("mlflow", field, cfg.backend)
        from mlflow.tracking import MlflowClient

        uri = cfg.tracking_uri
        if uri.startswith("file:"):
            path = Path(uri.removeprefix("file:").removeprefix("//"))
            uri = "file:" + str(_under(base, str(path)))
            # MLflow 3 refuses its file store unless told that it is wanted.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        if run_id:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            self.resumed = True
        else:
            exp = self.client.get_experiment_by_name(cfg.experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.experiment)
            self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
            self.resumed = False

    def config(self, config: dict[str, Any], step: int) -> None:
        self.client.log_dict(self.run_id, config, "config.json")
        if self.resumed:  # a param cannot change once logged: a resumed run has them already
            return
        from mlflow.entities import Param

        params = [Param(k[:250], str(v)[:6000]) for k, v in _flatten(config).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(1000 * time.time())
        batch = [Metric(_mlflow_key(k), v, now, step) for k, v in values.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def samples(self, name: str, rows: Sequence[SampleRow], step: int) -> None:
        # `log_table`'s own layout, without the pandas it needs (mlflow-skinny has none).
        table = {
            "columns": list(SAMPLE_COLUMNS),
            "data": [[r.prompt, r.response, r.reward] for r in rows],
        }
        self.client.log_dict(self.run_id, table, f"samples/{name}/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_BACKENDS: dict[str, Callable[..., Any]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


def _under(base: Path, folder: str) -> Path:
    path = Path(folder)
    return path if path.is_absolute() else base / path


def _mlflow_key(key: str) -> str:
    """MLflow keys allow alphanumerics, `_ - . / space`; others (`pass@n`) become `_`."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class Tracking:
    """Every configured tracker of rank 0, and the sample tables' bookkeeping."""

    def __init__(
        self,
        trackers: list[tuple[TrackerConfig, Tracker]],
        decode: Callable[[Iterable[int]], str],
        runs: Runs | None = None,
        runs_dir: Path | None = None,
    ) -> None:
        self.trackers = trackers
        self.decode = decode
        self.runs = runs or Runs({})
        self.runs_dir = runs_dir

    @classmethod
    def open(
        cls,
        config: JobConfig,
        base: Path,
        runs_dir: Path,
        resumed: bool,
        decode: Callable[[Iterable[int]], str],
        step: int,
        warm_up: Path | None = None,
    ) -> Tracking:
        """Start (or, `resumed`, continue the runs recorded in `runs_dir` of) every tracker.
        A trainer that is not resumed continues the runs of the warm-up whose checkpoint
        folder is `warm_up` (if it has any), from the warm-up's last step."""
        if resumed:
            known = Runs.read(runs_dir)
        else:
            warmed = Runs.read(warm_up)
            known = Runs(warmed.ids, warmed.offset + warmed.last_step)
        name = config.job.name
        trackers: list[tuple[TrackerConfig, Tracker]] = []
        for i, cfg in enumerate(config.job.tracking):
            key = f"{i}:{cfg.backend}"
            field = f"job.tracking[{i}]"
            run_id = known.ids.get(key)
            tracker = _BACKENDS[cfg.backend](cfg, field, base, cfg.run_name or name, run_id)
            known.ids[key] = tracker.run_id
            trackers.append((cfg, tracker))
            log.info("tracking.started", backend=cfg.backend, run_id=tracker.run_id, step=step)
        out = cls(trackers, decode, known, runs_dir if trackers else None)
        out._save()
        out._each("config", config.model_dump(mode="json"), out._at(step))
        return out

    def metrics(self, values: dict[str, float], step: int) -> None:
        finite = {k: v for k, v in values.items() if math.isfinite(v)}
        self._each("metrics", finite, self._at(step))

    def train_samples(self, batch: Batch, step: int) -> None:
        """A table of the batch's first samples, every `samples_every` steps."""
        for cfg, tracker in list(self.trackers):
            if cfg.samples and cfg.samples_every and step % cfg.samples_every == 0:
                rows = [
                    self._sample(s.prompt_ids, s.response_ids, s.reward)
                    for s in batch.samples[: cfg.samples]
                ]
                self._call(cfg, tracker, "samples", "train", rows, self._at(step))

    def eval_samples(self, groups: Sequence[Group], step: int) -> None:
        """A table of an eval round's first samples (one per group first, for variety)."""
        deepest = max((len(g.trajectories) for g in groups), default=0)
        ordered = [
            g.trajectories[i] for i in range(deepest) for g in groups if i < len(g.trajectories)
        ]
        for cfg, tracker in list(self.trackers):
            if cfg.samples:
                rows = [
                    self._sample(t.prompt_token_ids, t.response_token_ids, t.reward)
                    for t in ordered[: cfg.samples]
                ]
                self._call(cfg, tracker, "samples", "eval", rows, self._at(step))

    def close(self) -> None:
        self._each("close")
        self._save()  # the last step, for the RL trainer that continues a warm-up's runs

    def _at(self, step: int) -> int:
        """The trackers' step of this trainer's `step`; the last one is remembered."""
        self.runs.last_step = max(self.runs.last_step, step)
        return self.runs.offset + step

    def _save(self) -> None:
        if self.runs_dir is not None:
            self.runs.write(self.runs_dir)

    def _sample(self, prompt: Iterable[int], response: Iterable[int], reward: float) -> SampleRow:
        return SampleRow(self.decode(prompt), self.decode(response), float(reward))

    def _each(self, method: str, *args: Any) -> None:
        for cfg, tracker in list(self.trackers):
            self._call(cfg, tracker, method, *args)

    def _call(self, cfg: TrackerConfig, tracker: Tracker, method: str, *args: Any) -> None:
        try:
            getattr(tracker, method)(*args)
        except Exception as exc:  # a tracker's outage is not the job's
            log.warning("tracking.dropped", backend=cfg.backend, call=method, error=str(exc)[:300])
            self.trackers = [(c, t) for c, t in self.trackers if t is not tracker]
