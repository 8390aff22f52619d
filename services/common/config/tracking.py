"""`job.tracking`: the experiment trackers the trainer's rank 0 sends its metrics, the job
config and tables of generated samples to (W&B, TensorBoard, MLflow), one entry per backend."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kuberl.common.config.base import Section


class TrackerBase(Section):
    """What every backend shares: the run's name and how many samples its tables hold."""

    run_name: str | None = Field(
        None, description="The tracked run's display name (null: the job's name)."
    )
    samples: int = Field(
        4,
        ge=0,
        description="Generated samples (prompt, response, reward) per table: one table per eval "
        "round and one every `samples_every` trained steps. 0: no tables.",
    )
    samples_every: int = Field(
        10, ge=0, description="Trained steps between two training-sample tables (0: eval only)."
    )


class WandbTracking(TrackerBase):
    """Weights & Biases (`pip install 'kuberl[tracking]'`). Set `WANDB_API_KEY` for online runs;
    `mode: offline` (or `WANDB_MODE=offline`) writes the run under `dir` for `wandb sync`."""

    backend: Literal["wandb"]
    project: str = Field("kuberl", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user); null: the key's.")
    dir: str = Field("tracking", description="Where W&B writes its run files (`dir/wandb/`).")
    mode: Literal["online", "offline"] | None = Field(
        None, description="null: `WANDB_MODE` if set, else online."
    )
    tags: list[str] = Field(default_factory=list, description="Tags of the run.")


class TensorBoardTracking(TrackerBase):
    """TensorBoard event files (`tensorboard --logdir <dir>`)."""

    backend: Literal["tensorboard"]
    dir: str = Field(
        "tracking/tensorboard",
        description="Log folder; each run writes into `<dir>/<run name>-<id>`, which a resumed "
        "run keeps writing into.",
    )


class MlflowTracking(TrackerBase):
    """MLflow: a tracking server (`http://...`), a database (`sqlite:///...`, with the full
    `mlflow` package) or a local file store (`file:...`)."""

    backend: Literal["mlflow"]
    tracking_uri: str = Field(
        "file:tracking/mlruns",
        description="MLflow tracking URI; a relative `file:` path is under the trainer's "
        "working folder.",
    )
    experiment: str = Field("kuberl", description="Experiment the run is logged under.")


TrackerConfig = Annotated[
    WandbTracking | TensorBoardTracking | MlflowTracking, Field(discriminator="backend")
]
