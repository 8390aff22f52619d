"""The job file: one YAML document describing a whole kuberl run, and its schema.

Every service reads the same file (a ConfigMap on Kubernetes) with `load_job_config` and takes its
own section. The pydantic models are the schema and their field docs the reference documentation
(Helm's `values.schema.json` for the job section is generated from `JobConfig`). One module per
section; `rules` holds the checks that span sections, `env` the `KUBERL_<SECTION>__<FIELD>`
overrides and `errors` the wording of validation errors. Unknown fields are errors, and every
error names the field path and what was expected.
"""

from kuberl.common.config.algorithm import (
    BUILTIN_ADVANTAGES,
    BUILTIN_POLICY_LOSSES,
    AlgorithmConfig,
    DecoupledConfig,
    ImportanceConfig,
    KLConfig,
)
from kuberl.common.config.base import ConfigError, Section, ServerConfig
from kuberl.common.config.buffer import BufferConfig
from kuberl.common.config.data import ColumnsConfig, DataConfig, DatasetConfig
from kuberl.common.config.env import ENV_PREFIX, env_overrides
from kuberl.common.config.job import Endpoints, JobMeta, LocalModeConfig
from kuberl.common.config.jobfile import SECTIONS, JobConfig
from kuberl.common.config.loader import dump_job_config, load_job_config, parse_job_config
from kuberl.common.config.model import BuildModelConfig, LoraConfig, ModelConfig
from kuberl.common.config.redis import RedisConfig
from kuberl.common.config.reward import (
    BUILTIN_VERIFIERS,
    RewardConfig,
    RewardModelConfig,
    VerifierSpec,
)
from kuberl.common.config.rollout import (
    TOOL_RESPONSE_TEMPLATE,
    EngineConfig,
    MultiTurnConfig,
    RolloutConfig,
    SamplingConfig,
    SGLangEngineConfig,
    SimulatedEngineConfig,
    TorchEngineConfig,
)
from kuberl.common.config.rules import JOB_RULES
from kuberl.common.config.sandbox import SandboxConfig
from kuberl.common.config.tls import TLSConfig
from kuberl.common.config.tracking import (
    MlflowTracking,
    TensorBoardTracking,
    TrackerConfig,
    WandbTracking,
)
from kuberl.common.config.trainer import OptimizerConfig, TrainerConfig
from kuberl.common.config.weight_sync import TransportName, WeightSyncConfig

__all__ = [
    "BUILTIN_ADVANTAGES",
    "BUILTIN_POLICY_LOSSES",
    "BUILTIN_VERIFIERS",
    "ENV_PREFIX",
    "JOB_RULES",
    "SECTIONS",
    "TOOL_RESPONSE_TEMPLATE",
    "AlgorithmConfig",
    "BufferConfig",
    "BuildModelConfig",
    "ColumnsConfig",
    "ConfigError",
    "DataConfig",
    "DatasetConfig",
    "DecoupledConfig",
    "Endpoints",
    "EngineConfig",
    "ImportanceConfig",
    "JobConfig",
    "JobMeta",
    "KLConfig",
    "LocalModeConfig",
    "LoraConfig",
    "MlflowTracking",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimizerConfig",
    "RedisConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "SGLangEngineConfig",
    "SamplingConfig",
    "SandboxConfig",
    "Section",
    "ServerConfig",
    "SimulatedEngineConfig",
    "TLSConfig",
    "TensorBoardTracking",
    "TorchEngineConfig",
    "TrackerConfig",
    "TrainerConfig",
    "TransportName",
    "VerifierSpec",
    "WandbTracking",
    "WeightSyncConfig",
    "dump_job_config",
    "env_overrides",
    "load_job_config",
    "parse_job_config",
]
