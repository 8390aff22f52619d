"""The whole job file, `JobConfig`: every section, the cross-section rules and file checks."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from kuberl.common.config.base import ConfigError, Section
from kuberl.common.config.buffer import BufferConfig
from kuberl.common.config.data import DataConfig
from kuberl.common.config.job import Endpoints, JobMeta
from kuberl.common.config.model import ModelConfig
from kuberl.common.config.redis import RedisConfig
from kuberl.common.config.reward import RewardConfig
from kuberl.common.config.rollout import RolloutConfig
from kuberl.common.config.rules import JOB_RULES
from kuberl.common.config.tls import TLSConfig
from kuberl.common.config.trainer import TrainerConfig
from kuberl.common.config.weight_sync import WeightSyncConfig


class JobConfig(Section):
    """A whole kuberl job. Each service reads its own section and `endpoints`."""

    job: JobMeta = Field(default_factory=JobMeta)
    endpoints: Endpoints = Field(default_factory=Endpoints)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    tls: TLSConfig = Field(
        default_factory=TLSConfig, description="TLS / mutual TLS of every gRPC connection."
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)

    @model_validator(mode="after")
    def _rules(self) -> JobConfig:
        for rule in JOB_RULES:
            rule(self)
        return self

    def check_files(self, service: str, base: Path | None = None) -> None:
        """Raise ConfigError unless the files `service` reads at start are here ("all": every
        service's, as `kuberl run` and `kuberl config check --files` ask).

        `kuberl serve <service>` calls this before it binds a port, so a wrong path fails at
        once with the field that names it, instead of as a traceback deep in the start-up.
        Plain `kuberl config check` does not: a job file is often checked away from the volumes
        its pods mount. Relative paths are taken from `base` (default: the working directory),
        as the services do; hub ids (`org/name`) are left to `kuberl.common.hub`.
        """
        from kuberl.common.hub import is_hub_id

        root = base or Path.cwd()
        wanted = ("buffer", "reward", "rollout", "trainer") if service == "all" else (service,)
        problems: list[str] = []

        def need(
            field: str, path: str | None, what: str, fix: str, file: str = "", hub: bool = False
        ) -> None:
            if not path or (hub and is_hub_id(path, root)):
                return
            p = Path(path).expanduser()
            p = (p if p.is_absolute() else root / p) / file
            if not p.exists():
                problems.append(f"{field}: {p} does not exist ({what}); {fix}")

        model_fix = (
            "fix the path or give a hub id (Qwen/Qwen2.5-0.5B-Instruct), or set model.path: null "
            "to build a small model (model.build)"
        )
        if {"rollout", "trainer"} & set(wanted) and self.model.path:
            need(
                "model.path",
                self.model.path,
                "a Hugging Face model folder has config.json",
                model_fix,
                "config.json",
                hub=True,
            )
        tc = self.trainer
        if "trainer" in wanted and tc.sft_data and (tc.mode == "sft" or tc.sft_steps):
            need(
                "trainer.sft_data",
                tc.sft_data,
                "JSONL of prompt/response pairs",
                "fix the path, or set trainer.sft_data: null",
            )
        rm = self.reward.reward_model
        if "reward" in wanted and rm is not None and "rm" in self.reward.verifiers:
            need(
                "reward.reward_model.path",
                rm.path,
                "a Hugging Face sequence-classification folder",
                "mount it, fix the path or give a hub id",
                "config.json",
                hub=True,
            )
        if "buffer" in wanted:
            for kind in ("train", "eval"):
                for i, ds in enumerate(getattr(self.data, kind)):
                    need(
                        f"data.{kind}[{i}].path",
                        ds.path,
                        "a .jsonl or .parquet file, or a dataset folder",
                        f"fix the path (relative paths start at {root}), or give a hub "
                        "dataset id such as openai/gsm8k",
                        hub=True,
                    )
            for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
                need(
                    f"redis.{name}",
                    getattr(self.redis, name),
                    "PEM file",
                    "mount the Redis TLS secret there or fix the path",
                )
        if self.tls.enabled:
            for name in ("ca_file", "cert_file", "key_file", "client_cert_file", "client_key_file"):
                need(
                    f"tls.{name}",
                    getattr(self.tls, name),
                    "PEM file",
                    "mount the TLS secret there or fix the path",
                )
        if problems:
            raise ConfigError(f"cannot start {service}:\n  " + "\n  ".join(problems))


#: The job file's top-level sections, in order.
SECTIONS = tuple(JobConfig.model_fields)
