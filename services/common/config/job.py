"""The `job` section (name, seed, local-mode settings) and the services' `endpoints`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kuberl.common.config.base import Section
from kuberl.common.config.tracking import TrackerConfig


class LocalModeConfig(Section):
    """How `kuberl run` (the local supervisor, `kuberl.local`) runs the job on one machine.

    Read by the supervisor only; services and the Helm chart ignore it. Each field has a
    command-line flag of `kuberl run` that overrides it."""

    rollout_replicas: int = Field(
        2, ge=1, description="Rollout processes (`--rollout-replicas`), each its own replica."
    )
    trainer_processes: int = Field(
        1,
        ge=1,
        description="Trainer processes (`--trainer-processes`): torchrun's workers when more "
        "than one; a single one runs without torchrun.",
    )
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="cpu: every process on CPU (CUDA hidden). cuda: the trainer and the torch "
        "rollout engines share GPU 0 and weight-sync offers CUDA IPC first (`--device`); one "
        "rollout replica unless `--rollout-replicas` is given or, with `device: cuda` in the "
        "file, `rollout_replicas` is set beside it.",
    )
    max_restarts: int = Field(
        2, ge=0, description="Times a crashed service is restarted before the run fails."
    )
    start_timeout_seconds: float = Field(
        300.0, gt=0, description="How long a service may take to report SERVING."
    )
    warm_start_lr: float | None = Field(
        None,
        gt=0,
        description="The SFT warm start (`trainer.sft_steps` on `trainer.sft_data`) runs as its "
        "own trainer run before the services start, and RL starts from its weights; this is its "
        "learning rate (null: `trainer.optimizer.lr`). SFT usually wants a far larger rate than "
        "RL.",
    )
    warm_start_lora: bool = Field(
        True,
        description="With `model.lora`: the warm start trains the adapters too, and RL starts "
        "from its merged model (`merged/`) with fresh adapters. false: it trains every weight "
        "(a locally built model is random until its warm start, and adapters over random "
        "weights learn little); RL then trains adapters over its export.",
    )
    roles: bool = Field(
        True,
        description="Give each process of the run its own role token and check every "
        "restricted call against it (docs/security.md). false: every local caller has every "
        "role, as with services started by hand (a harness that calls them as any role).",
    )


class JobMeta(Section):
    name: str = Field(
        "kuberl",
        pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
        description="Job name (a DNS label); prefixes every Redis key as kuberl:{name}:...",
    )
    seed: int = Field(0, description="Seed for data shuffling, sampling and initialisation.")
    run_dir: str = Field("runs", description="Where local runs write their run folder.")
    local: LocalModeConfig = Field(
        default_factory=LocalModeConfig, description="Local mode (`kuberl run`) only."
    )
    tracking: list[TrackerConfig] = Field(
        default_factory=list,
        description="Experiment trackers (`backend`: wandb, tensorboard, mlflow) the trainer "
        "sends its metrics, the job config and generated samples to (docs/trainer.md).",
    )


class Endpoints(Section):
    """Where each service is reached (host:port). Kubernetes sets these to Service DNS names."""

    buffer: str = "127.0.0.1:50051"
    reward: str = "127.0.0.1:50052"
    weight_sync: str = "127.0.0.1:50053"
    trainer: str = "127.0.0.1:50054"
