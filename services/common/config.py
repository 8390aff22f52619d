"""The job file: one YAML document describing a whole kuberl run, and its schema.

Every service reads the same file (a ConfigMap on Kubernetes) with `load_job_config` and takes its
own section. The pydantic models below are the schema and their field docs are the reference
documentation; Helm's `values.schema.json` for the job section is generated from `JobConfig`.
Environment variables `KUBERL_<SECTION>__<FIELD>[__<SUBFIELD>...]` override the file (values are
parsed as YAML scalars, so `KUBERL_TRAINER__ZERO_STAGE=2` is an int). Unknown fields are errors,
and every error names the field path and what was expected.
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)

ENV_PREFIX = "KUBERL_"


class Section(BaseModel):
    """Base of every config model: unknown fields are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


class ServerConfig(Section):
    """How one service listens."""

    host: str = Field("0.0.0.0", description="Address the gRPC server binds to.")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free port.")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free port."
    )
    max_message_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024,
        description="Largest gRPC message sent or received (gRPC's own default is only 4 MiB).",
    )
    grace_seconds: float = Field(
        10.0, ge=0, description="On SIGTERM, how long in-flight calls may run before cancellation."
    )


def _server(port: int, metrics_port: int) -> Any:
    return Field(
        default_factory=lambda: ServerConfig(port=port, metrics_port=metrics_port),
        description="gRPC and metrics listeners of this service.",
    )


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


class Endpoints(Section):
    """Where each service is reached (host:port). Kubernetes sets these to Service DNS names."""

    buffer: str = "127.0.0.1:50051"
    reward: str = "127.0.0.1:50052"
    weight_sync: str = "127.0.0.1:50053"
    trainer: str = "127.0.0.1:50054"


class RedisConfig(Section):
    url: str | None = Field(
        None,
        description="redis:// or rediss:// URL of the job's Redis; null starts an embedded "
        "server (local mode only).",
    )
    password_env: str = Field(
        "REDIS_PASSWORD", description="Environment variable holding the Redis password, if any."
    )
    connect_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="How long a service waits for Redis at start, and how long a request keeps "
        "retrying while Redis is unreachable (e.g. restarting) before answering UNAVAILABLE.",
    )
    tls_ca_file: str | None = Field(
        None,
        description="PEM CA bundle that signed the Redis server's certificate (rediss:// URLs; "
        "null: the system's CAs).",
    )
    tls_cert_file: str | None = Field(
        None,
        description="PEM client certificate for a Redis that requires one (`tls-auth-clients`).",
    )
    tls_key_file: str | None = Field(None, description="Private key of `tls_cert_file` (PEM).")

    @model_validator(mode="after")
    def _tls_files(self) -> RedisConfig:
        if self.url is not None and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"url {self.url!r} is not a Redis URL: use redis://host:port/db, "
                "rediss://host:port/db (TLS) or unix:///path/to/socket"
            )
        tls_set = self.tls_ca_file or self.tls_cert_file or self.tls_key_file
        if tls_set and not (self.url or "").startswith("rediss://"):
            raise ValueError(
                "tls_*_file are set but url is not rediss:// (the embedded server has no TLS): "
                "use url: rediss://host:port/0 for TLS, or remove the tls_*_file fields"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        return self


class TLSConfig(Section):
    """TLS and mutual TLS for every gRPC server and client of the job (`kuberl.common.tls`).

    Off by default: local mode talks over loopback, and on Kubernetes NetworkPolicies already
    limit who reaches a service. When enabled, every service serves TLS with `cert_file` /
    `key_file`, and verifies the services it calls against `ca_file`. With
    `require_client_cert` (mutual TLS) servers also refuse any caller without a certificate
    signed by `ca_file`, and every client presents `client_cert_file` / `client_key_file` (by
    default the same pair as the server: issue it for both serverAuth and clientAuth). Files are
    PEM; servers re-read them when they change, so a rotated certificate (cert-manager) is
    served to new connections without a restart. docs/security.md shows a set-up."""

    enabled: bool = Field(False, description="Serve and call gRPC over TLS.")
    ca_file: str | None = Field(
        None,
        description="PEM CA bundle that verifies peers: the servers a service calls and, with "
        "require_client_cert, the clients calling it (null: the system's CAs, clients only).",
    )
    cert_file: str | None = Field(
        None, description="PEM certificate chain the servers present (SANs: the service names)."
    )
    key_file: str | None = Field(None, description="Private key of cert_file (PEM).")
    require_client_cert: bool = Field(
        False, description="Mutual TLS: refuse callers without a certificate signed by ca_file."
    )
    client_cert_file: str | None = Field(
        None, description="PEM certificate clients present under mutual TLS (null: cert_file)."
    )
    client_key_file: str | None = Field(
        None, description="Private key of client_cert_file (null: key_file)."
    )
    server_name_override: str | None = Field(
        None,
        description="Name clients expect in the servers' certificates instead of the host they "
        "dial (e.g. one certificate for every service; testing only otherwise).",
    )
    roles: bool = Field(
        False,
        description="Per-RPC roles (mutual TLS only): each component's certificate names it "
        "with a URI SAN spiffe://kuberl/<job>/<component>[/<instance>], and each service lets "
        "only the roles that need them call its state-changing methods (rollout leases and "
        "puts, the trainer reads, acknowledges, sets versions and publishes); anything else is "
        "PERMISSION_DENIED. Needs one certificate per component (docs/security.md).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TLSConfig:
        if not self.enabled:
            if self.require_client_cert:
                raise ValueError(
                    "require_client_cert needs TLS: set tls.enabled: true (and the files)"
                )
            return self
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together: set both or neither")
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise ValueError(
                "client_cert_file and client_key_file go together: set both or neither"
            )
        if self.roles and not self.require_client_cert:
            raise ValueError(
                "tls.roles reads the caller's certificate: set tls.require_client_cert: true"
            )
        if self.require_client_cert:
            if not self.ca_file:
                raise ValueError(
                    "require_client_cert: servers check client certificates against ca_file; "
                    "set tls.ca_file to the CA that signs them"
                )
            if not (self.cert_file or self.client_cert_file):
                raise ValueError(
                    "require_client_cert: clients must present a certificate; set "
                    "tls.cert_file/key_file (or tls.client_cert_file/client_key_file)"
                )
        return self


class BuildModelConfig(Section):
    """A small model of a real architecture built locally (no downloads)."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    size: Literal["tiny", "small"] = Field(
        "tiny", description="tiny is ~1M parameters, small ~10M."
    )
    tokenizer: Literal["digits", "bpe"] = Field(
        "digits",
        description="digits: a character tokenizer for arithmetic tasks; bpe: trained "
        "on the job's training data with the `tokenizers` library.",
    )


class ModelConfig(Section):
    path: str | None = Field(
        None, description="Local HF model folder (weights + tokenizer). Null builds one (`build`)."
    )
    build: BuildModelConfig = Field(default_factory=BuildModelConfig)
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Training and rollout dtype (float32 on CPU)."
    )
    chat_template: bool = Field(
        False, description="Apply the tokenizer's chat template to prompts before generation."
    )


class ColumnsConfig(Section):
    prompt: str = "prompt"
    answer: str = "answer"
    metadata: list[str] = Field(
        default_factory=list, description="Columns kept as metadata; empty keeps every other one."
    )


class DatasetConfig(Section):
    path: str = Field(description="A .jsonl or .parquet file.")
    name: str | None = Field(None, description="Name in the job; defaults to the file stem.")
    columns: ColumnsConfig = Field(default_factory=ColumnsConfig)
    limit: int = Field(0, ge=0, description="Use only the first N rows (0 = all).")
    verifiers: dict[str, float] | None = Field(
        None, description="Reward verifiers and weights for this dataset (default: reward's)."
    )


class DataConfig(Section):
    train: list[DatasetConfig] = Field(default_factory=list)
    eval: list[DatasetConfig] = Field(default_factory=list)
    num_epochs: int = Field(1, ge=1, description="Passes over the training prompts.")

    @model_validator(mode="after")
    def _unique_names(self) -> DataConfig:
        """The buffer keeps one dataset per name (its file stem unless `name` is set): a second
        of the same name was loaded as 'already loaded', its prompts silently missing."""
        seen: dict[str, str] = {}
        for kind, datasets in (("train", self.train), ("eval", self.eval)):
            for i, d in enumerate(datasets):
                name, where = d.name or Path(d.path).stem, f"data.{kind}[{i}] ({d.path})"
                if name in seen:
                    raise ValueError(
                        f"{where} and {seen[name]} are both named {name!r}: give one of them a "
                        "`name` (dataset names must be unique across train and eval)"
                    )
                seen[name] = where
        return self


class BufferConfig(Section):
    server: ServerConfig = _server(50051, 9101)
    lease_timeout_seconds: float = Field(
        120.0, gt=0, description="A leased prompt not completed within this is re-delivered."
    )
    max_inflight_groups: int = Field(
        64,
        ge=1,
        description="Backpressure: leasing is refused while this many groups are leased or "
        "generated but not yet trained.",
    )
    batch_ack_timeout_seconds: float = Field(
        300.0, gt=0, description="An un-acked batch is re-delivered after this (trainer crash)."
    )
    requeue_stale: bool = Field(
        True, description="Re-queue the prompts of groups dropped as stale (else count and drop)."
    )
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards all agree."
    )
    filters: list[str] = Field(
        default_factory=list,
        description="Custom group filters as module:function, called (group) -> bool (keep), "
        "with a kuberl.common.trajectory.Group; applied to training groups only.",
    )
    backpressure_retry_seconds: float = Field(
        1.0, gt=0, description="retry-after hint sent with RESOURCE_EXHAUSTED on LeasePrompts."
    )
    payload_cache_mib: int = Field(
        256,
        ge=0,
        description="Memory (MiB) for the bytes of groups this replica accepted, kept until a "
        "batch of this replica takes them so it need not read them back from Redis (oldest "
        "evicted first; a miss reads Redis; 0 = off). Counts against the pod's memory limit.",
    )
    acked_batch_ttl_seconds: float = Field(
        7 * 24 * 3600.0,
        gt=0,
        description="How long the record of an acknowledged batch is kept so that a repeated "
        "Ack answers already_acked (afterwards it is NOT_FOUND).",
    )
    max_sequence_tokens: int = Field(
        0,
        ge=0,
        description="Most prompt + response tokens of one sample a put may carry (0 = the "
        "model's max_position_embeddings, read from model.path/config.json when the buffer "
        "can read it, else no bound: set it where the buffer does not mount the model).",
    )


class VerifierSpec(Section):
    """A custom verifier loaded from a dotted path (`kuberl.reward.verifiers.custom`).

    The function is called as `function(sample)` with a `kuberl.reward.sample.RewardSample` and
    returns a number (bool and int count). A plain function runs in the reward service's worker
    processes, so a hang is cut off by killing the worker; an `async def` runs on the service's
    event loop (for I/O such as calling a judge model) and is cancelled at the timeout."""

    function: str = Field(description="module:function taking (sample) and returning a float.")
    description: str = ""


class SandboxConfig(Section):
    """Limits and isolation of a code sandbox (`kuberl.common.sandbox`), per program: the reward
    service's `code` verifier (`reward.sandbox`) and the rollout `python` tool
    (`rollout.multi_turn.sandbox`) each have one."""

    cpu_seconds: int = Field(5, ge=1, description="RLIMIT_CPU of each test program.")
    memory_bytes: int = Field(
        512 * 1024 * 1024, ge=16 * 1024 * 1024, description="RLIMIT_AS of each test program."
    )
    max_processes: int = Field(
        16,
        ge=1,
        description="RLIMIT_NPROC: processes (and threads) a program may have at once.",
    )
    max_file_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="RLIMIT_FSIZE: largest file a program may write."
    )
    max_open_files: int = Field(64, ge=8, description="RLIMIT_NOFILE.")
    wall_seconds: float = Field(
        10.0,
        gt=0,
        description="Wall-clock limit of one program (one test; for the python tool, at most "
        "multi_turn.tool_timeout_seconds); its processes are killed.",
    )
    max_output_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        description="Stdout kept per program; a program writing more is killed and fails.",
    )
    max_concurrent: int = Field(
        2,
        ge=1,
        description="Sandboxed runs (reward samples, python tool calls) executing at the same "
        "time; more wait for a free slot.",
    )
    uid_base: int = Field(
        61000,
        ge=1000,
        description="When the service runs as root, each concurrent run executes as its own "
        "uid/gid, the first max_concurrent ids from uid_base up that no other sandbox (reward or "
        "rollout service) on the host holds (claimed with lock files): these ids must belong to "
        "nobody else.",
    )
    tmpfs_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024 * 1024,
        description="Size of the private /tmp (and working directory) of a run, where a mount "
        "namespace is available.",
    )
    require_isolation: bool = Field(
        False,
        description="Refuse to start unless runs get their own network namespace, private "
        "/tmp, /var/tmp and /dev/shm (a mount namespace) and a dedicated uid (the service runs "
        "as root on a kernel that allows namespaces). Without "
        "it, the sandbox falls back to what it can get (a user-namespace network namespace, "
        "rlimits, process-tree cleanup) and logs a warning.",
    )
    python: str | None = Field(
        None, description="Interpreter for the programs (null: the service's own)."
    )


class RewardModelConfig(Section):
    """A sequence-classification reward model (`kuberl.reward.verifiers.reward_model`)."""

    path: str = Field(description="Local HF sequence-classification model folder.")
    batch_size: int = Field(16, ge=1)
    device: str = "cpu"
    max_length: int = Field(
        4096, ge=8, description="Prompt + response tokens kept (the left end is cut)."
    )
    chat_template: bool = Field(
        True,
        description="Format (prompt, response) as a user/assistant chat with the tokenizer's "
        "template when it has one; else the two texts are concatenated.",
    )


#: Verifiers built into the reward service; `custom` names must differ from these.
BUILTIN_VERIFIERS = ("gsm8k", "math", "code", "format", "regex", "length", "rm")


class RewardConfig(Section):
    """The reward service (`kuberl.reward`): which verifiers score a sample and how.

    The reward of a sample is sum(weight * score) over `verifiers` (or over the sample's own
    `verifiers` list, see docs/reward.md); a verifier that raises, hangs past `timeout_seconds`
    or returns NaN makes the sample's reward `fallback_reward` with the reason in its error."""

    server: ServerConfig = _server(50052, 9102)
    verifiers: dict[str, float] = Field(
        default_factory=lambda: {"gsm8k": 1.0},
        description="Verifier name -> weight; the reward is the weighted sum of their scores. "
        "Names: gsm8k, math, code, format, regex, length, rm, or a key of `custom`.",
    )
    custom: dict[str, VerifierSpec] = Field(
        default_factory=dict, description="Extra verifiers by name, usable in `verifiers`."
    )
    timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="Per-sample scoring timeout of each backend (the worker-process verifiers "
        "of a sample together, one code run, one reward-model batch, one async custom call).",
    )
    fallback_reward: float = Field(
        0.0, description="Reward of a sample whose verifier raised, hung or returned NaN."
    )
    workers: int = Field(2, ge=1, description="Processes scoring CPU-bound verifiers.")
    length_soft_limit: int = Field(
        0,
        ge=0,
        description="DAPO overlong penalty starts here (0 = max_new_tokens - buffer, or "
        "max_new_tokens - 1 with no buffer: a response cut at the budget gets -1).",
    )
    length_penalty_buffer: int = Field(
        0, ge=0, description="Tokens over which the penalty grows linearly from 0 to -1."
    )
    format_pattern: str = Field(
        r"(?s)\A\s*<think>.*?</think>\s*\S",
        description="Regex the `format` verifier searches for (re.search; anchor it with \\A "
        "to require it at the start). The default requires a closed <think> block first, then "
        "a non-empty answer.",
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    reward_model: RewardModelConfig | None = None

    @model_validator(mode="after")
    def _known_verifiers(self) -> RewardConfig:
        import math
        import re

        shadowing = sorted(set(self.custom) & set(BUILTIN_VERIFIERS))
        if shadowing:
            raise ValueError(f"custom verifiers may not reuse built-in names: {shadowing}")
        known = (*BUILTIN_VERIFIERS, *self.custom)
        for name, weight in self.verifiers.items():
            if name not in known:
                raise ValueError(
                    f"verifiers: unknown verifier {name!r}; expected one of {', '.join(known)}"
                )
            if not math.isfinite(weight):
                raise ValueError(f"verifiers: weight of {name!r} must be finite (got {weight})")
        if "rm" in self.verifiers and self.reward_model is None:
            raise ValueError("verifiers: 'rm' needs a reward_model section (path of the model)")
        try:
            re.compile(self.format_pattern)
        except re.error as exc:
            raise ValueError(f"format_pattern is not a valid regex: {exc}") from None
        return self


class SamplingConfig(Section):
    """Sampling parameters of every generation (SGLang's `sampling_params`)."""

    temperature: float = Field(1.0, ge=0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    max_new_tokens: int = Field(256, ge=1)
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Token ids that end a response (besides EOS)."
    )
    ignore_eos: bool = Field(False, description="Keep generating after the EOS token.")


class TorchEngineConfig(Section):
    """The in-process HF transformers engine (local mode, CI, single-GPU tests)."""

    kind: Literal["torch"] = "torch"
    device: str = Field("cpu", description="cpu or cuda[:N].")
    max_batch_size: int = Field(64, ge=1, description="Sequences generated together.")
    seed: int | None = Field(None, description="Seed of the sampling generator (null: job.seed).")
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="transformers attention kernel."
    )
    batch_wait_seconds: float = Field(
        0.005,
        ge=0,
        description="Before starting a batch, wait this long for more requests to join it.",
    )
    num_threads: int = Field(
        0,
        ge=0,
        description="torch intra-op CPU threads (0 = torch's default, one per core); small "
        "models on a shared CPU run much faster with 1.",
    )


class SGLangEngineConfig(Section):
    """A client of an SGLang server's native HTTP API (pinned to sglang 0.5.23)."""

    kind: Literal["sglang"] = "sglang"
    url: str = Field("http://127.0.0.1:30000", description="Base URL of the SGLang server.")
    launch: bool = Field(
        False, description="Start `python -m sglang.launch_server` beside the replica."
    )
    launch_args: list[str] = Field(
        default_factory=list, description="Extra command-line arguments of launch_server."
    )
    tp_size: int = Field(1, ge=1)
    mem_fraction_static: float = Field(0.8, gt=0, le=1)
    request_timeout_seconds: float = Field(600.0, gt=0)
    connect_timeout_seconds: float = Field(10.0, gt=0)
    startup_timeout_seconds: float = Field(
        900.0, gt=0, description="How long to wait for /health_generate after launch."
    )
    max_retries: int = Field(3, ge=0, description="Retries of a call on 5xx / connect errors.")
    retry_backoff_seconds: float = Field(
        0.5, ge=0, description="First retry delay; doubled each attempt."
    )
    api_key_env: str | None = Field(
        None, description="Environment variable holding the server's --api-key, if any."
    )
    snapshot_dir: str = Field(
        ".kuberl/sglang-weights",
        description="Folder where a weight snapshot is written for SGLang's "
        "/update_weights_from_disk (the fallback when a version does not come by NCCL): the "
        "SGLang server must read it at the same path, so it is sent as an absolute path (a "
        "relative one is taken from the rollout's working directory). On Kubernetes the chart "
        "sets it to a volume both containers of the rollout pod mount.",
    )


def _engine_kind(value: Any) -> str:
    """The engine section's `kind`, `torch` (its default) when left out: an engine section
    without it, e.g. `{max_batch_size: 4}` or KUBERL_ROLLOUT__ENGINE__DEVICE alone, was refused
    as 'Unable to extract tag'."""
    kind = value.get("kind", "torch") if isinstance(value, dict) else getattr(value, "kind", "")
    return str(kind)


EngineConfig = Annotated[
    Annotated[TorchEngineConfig, Tag("torch")] | Annotated[SGLangEngineConfig, Tag("sglang")],
    Discriminator(_engine_kind),
]


TOOL_RESPONSE_TEMPLATE = "\n<tool_response>\n{output}\n</tool_response>\n"


class MultiTurnConfig(Section):
    """Built-in multi-turn tool calling: `<tool_call>{json}</tool_call>` runs a tool."""

    enabled: bool = False
    max_turns: int = Field(4, ge=1, description="Model turns per sample (tool turns between).")
    tools: list[str] = Field(
        default_factory=lambda: ["calculator"],
        description="Built-in tool names (calculator, python) or module:function.",
    )
    describe_tools: bool = Field(
        True,
        description="With model.chat_template, pass the tools' JSON schemas to the tokenizer's "
        "chat template (`tools=`), which tells the model the tools and the <tool_call> format "
        "(Qwen2.5 and Hermes templates do); off, or without a chat template, the prompt text "
        "must describe them.",
    )
    tool_timeout_seconds: float = Field(5.0, gt=0, description="Wall time of one tool call.")
    max_tool_output_chars: int = Field(
        1024, ge=16, description="Tool output is truncated to this before tokenization."
    )
    max_total_tokens: int = Field(
        0, ge=0, description="Response budget over all turns (0 = sampling.max_new_tokens)."
    )
    tool_response_template: str = Field(
        TOOL_RESPONSE_TEMPLATE,
        description="Text appended after a tool call, {output} standing for the tool's output "
        "(tokenized on its own, loss mask 0). The default keeps the model's turn open; a chat "
        "model may want its template's tool turn, e.g. for ChatML (Qwen2.5): "
        '"<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{output}\\n</tool_response>'
        '<|im_end|>\\n<|im_start|>assistant\\n".',
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig,
        description="Where the `python` tool runs model-written code: a separate process per "
        "call with its own network namespace, private /tmp and dedicated uid where the host "
        "allows it (see docs/rollout.md); unused unless `tools` lists python.",
    )

    @model_validator(mode="after")
    def _one_output_slot(self) -> MultiTurnConfig:
        if self.tool_response_template.count("{output}") != 1:
            raise ValueError(
                "tool_response_template must contain {output} exactly once (where the tool's "
                f"output goes): got {self.tool_response_template!r}"
            )
        return self


class RolloutConfig(Section):
    server: ServerConfig = _server(50060, 9110)
    engine: EngineConfig = Field(default_factory=TorchEngineConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    group_size: int = Field(8, ge=1, description="Samples generated per prompt (GRPO's n).")
    prompts_per_batch: int = Field(8, ge=1, description="Prompts leased per engine batch.")
    batches_in_flight: int = Field(2, ge=1, description="Engine batches kept in flight.")
    rollout_function: str | None = Field(
        None,
        description="module:function replacing the built-in rollout (slime-style); called "
        "as fn(context, prompt) and returns the group's samples.",
    )
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    on_weight_update: Literal["finish", "abort"] = Field(
        "finish",
        description="In-flight generations when new weights arrive: finish on the old "
        "weights, or abort and re-queue.",
    )
    mode: Literal["rl", "eval", "rejection_sampling"] = "rl"
    rejection_threshold: float = Field(
        1.0, description="rejection_sampling keeps samples with reward >= this."
    )
    replica_id: str | None = Field(
        None,
        description="Consumer name at the buffer (the pod name); null uses the hostname "
        "and process id.",
    )
    drain_seconds: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM or Drain, how long in-flight prompts may finish before they "
        "are aborted and released to the buffer.",
    )
    rpc_timeout_seconds: float = Field(30.0, gt=0, description="Deadline of buffer/reward RPCs.")
    retry_initial_seconds: float = Field(
        0.2, gt=0, description="First backoff after a transient buffer/reward error."
    )
    retry_max_seconds: float = Field(10.0, gt=0, description="Longest backoff.")
    max_attempts: int = Field(
        6,
        ge=1,
        description="Attempts of a Score or PutTrajectories call before the batch's prompts "
        "are released back to the buffer.",
    )
    idle_poll_seconds: float = Field(
        1.0, gt=0, description="Wait between leases when the prompt stream is empty."
    )
    lease_wait_seconds: float = Field(
        2.0,
        ge=0,
        le=600,
        description="While the buffer's in-flight window (buffer.max_inflight_groups) is full, "
        "a lease waits at the buffer up to this long for room and starts as soon as the trainer "
        "frees some; 0 takes the refusal at once and sleeps the buffer's retry-after hint.",
    )
    version_wait_seconds: float = Field(
        10.0,
        ge=0,
        description="A leased training prompt is not generated on weights too old to be "
        "trained: while the engine's version is below the buffer's policy version minus "
        "trainer.max_staleness (the group would be dropped as stale), its batch waits up to "
        "this long for the weight update, then generates anyway; 0 = never wait.",
    )
    weight_sync: bool = Field(
        True,
        description="Register with the weight-sync service (endpoints.weight_sync), catch up "
        "to its current version before leasing, and load every new version; false keeps the "
        "initial weights (eval-only replicas, tests).",
    )
    catch_up_seconds: float = Field(
        300.0, gt=0, description="How long to wait for the current version at start."
    )


class KLConfig(Section):
    """KL to the frozen reference policy (Schulman's estimators, `kuberl.trainer.algorithms`)."""

    coef: float = Field(0.0, ge=0, description="0 disables the reference model.")
    estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="k1 = log(pi/pi_ref); k2 = (log(pi/pi_ref))^2 / 2; "
        "k3 = pi_ref/pi - 1 - log(pi_ref/pi) (unbiased and >= 0).",
    )
    offload_reference: bool = Field(
        False,
        description="Keep the frozen reference policy's weights in CPU memory between uses. "
        "With zero_stage 3 it is DeepSpeed's offload_param (each rank's partition lives in CPU "
        "memory; layers are fetched to the device for their forward); with stages 0-2 the whole "
        "reference moves to the device for each reference pass and back to CPU after it. Frees "
        "the reference's device memory for training at the price of a host-to-device copy per "
        "step; nothing changes on a CPU trainer.",
    )
    in_reward: bool = Field(
        False,
        description="Subtract coef * KL from the reward (per token for reinforce_pp and gae, "
        "summed over the response for grpo, drgrpo and rloo) instead of adding it to the loss.",
    )


class ImportanceConfig(Section):
    """Correction of the train-inference mismatch using the rollout engine's logprobs."""

    mode: Literal["none", "tis", "mis"] = Field(
        "tis",
        description="ratio = pi_train / pi_rollout per token. tis: weight each token's loss by "
        "min(ratio, cap), detached; mis: drop tokens (or sequences) whose ratio is outside "
        "[1/threshold, threshold]; none: no correction (the mismatch is still reported).",
    )
    cap: float = Field(2.0, gt=0, description="TIS: per-token weight min(ratio, cap).")
    threshold: float = Field(
        2.0,
        gt=1,
        description="MIS: drop tokens (or sequences) whose ratio exceeds this or is below its "
        "inverse.",
    )
    level: Literal["token", "sequence"] = Field(
        "token",
        description="sequence: one ratio per sequence, the geometric mean of its token ratios "
        "exp(mean log ratio), applied to all its tokens.",
    )


class AlgorithmConfig(Section):
    """The RL algorithm: advantage estimator, policy loss, KL and mismatch correction.

    Read by `kuberl.trainer.algorithms` (see docs/algorithms.md for the formulas)."""

    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp", "gae"] = Field(
        "grpo",
        description="grpo: (r - group mean) / (group std + eps); drgrpo: r - group mean (use "
        "loss_agg token_sum with loss_norm_tokens for its length-unbiased loss); rloo: r - mean "
        "of the other samples of the group; reinforce_pp: discounted token returns normalised "
        "over the batch; gae: PPO with a critic.",
    )
    normalize_std: bool = Field(True, description="GRPO: divide by the group's std.")
    std_eps: float = Field(
        1e-6, gt=0, description="Added to a std before dividing by it (grpo, reinforce_pp, gae)."
    )
    whiten_advantages: bool = Field(
        True, description="gae: normalise advantages to mean 0, std 1 over the batch's tokens."
    )
    policy_loss: Literal["ppo", "gspo"] = Field(
        "ppo",
        description="ppo: token-level clipped ratio; gspo: sequence-level ratio "
        "exp(mean token log-ratio), clipped per sequence (use small clips, e.g. 3e-4 / 4e-4).",
    )
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0, description="> clip_low is DAPO clip-higher.")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip constant c (e.g. 3).")
    loss_agg: Literal["token_mean", "seq_mean", "token_sum"] = Field(
        "token_mean",
        description="token_mean: sum over tokens / number of tokens (DAPO); seq_mean: mean over "
        "sequences of each sequence's token mean (original GRPO); token_sum: sum over tokens / "
        "(number of sequences * loss_norm_tokens) (Dr.GRPO's constant normaliser).",
    )
    loss_norm_tokens: int | None = Field(
        None,
        ge=1,
        description="token_sum: the constant length normaliser (Dr.GRPO uses the generation "
        "budget, max_new_tokens); null uses the batch's padded length T.",
    )
    entropy_coef: float = 0.0
    value_clip: float | None = Field(
        0.2, gt=0, description="gae: clip the critic's new values to old +- this (null: off)."
    )
    kl: KLConfig = Field(default_factory=KLConfig)
    importance: ImportanceConfig = Field(default_factory=ImportanceConfig)
    ppo_epochs: int = Field(1, ge=1)
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per batch and epoch.")
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    recompute_old_logprobs: bool = Field(
        False,
        description="Recompute old logprobs with the trainer (one forward pass without "
        "gradient per step). Off: with one update per batch the current logprobs are the old "
        "ones; with several (ppo_epochs * mini_batches > 1) the rollout engine's logprobs are "
        '("bypass": the PPO ratio is taken against the engine, and importance.mode must be '
        "none).",
    )

    @model_validator(mode="after")
    def _importance_needs_old_logprobs(self) -> AlgorithmConfig:
        updates = self.ppo_epochs * self.mini_batches
        if self.importance.mode != "none" and updates > 1 and not self.recompute_old_logprobs:
            raise ValueError(
                f"importance.mode {self.importance.mode!r} weighs tokens by pi_old / pi_rollout, "
                f"and with {updates} updates per batch (ppo_epochs * mini_batches) pi_old is known "
                "only if recompute_old_logprobs is true. Set recompute_old_logprobs: true (one "
                "extra forward pass per step), or importance.mode: none (the PPO ratio is then "
                "taken against the rollout engine's logprobs, and its clip bounds the mismatch)"
            )
        return self


class OptimizerConfig(Section):
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0, description="AdamW's epsilon.")
    grad_clip: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)


class TrainerConfig(Section):
    """The trainer (`kuberl.trainer`): DeepSpeed engine, training loop, checkpoints and modes.

    docs/trainer.md is the user guide. One trainer *step* consumes one batch of
    `groups_per_step` whole groups from the buffer (rl) or `sft_batch_size` sequences (sft) and
    makes `algorithm.ppo_epochs * algorithm.mini_batches` optimizer updates from it; the policy
    version goes up by one per step."""

    server: ServerConfig = _server(50054, 9104)
    mode: Literal["rl", "sft", "eval"] = Field(
        "rl",
        description="rl: RL on the buffer's TRAIN stream; sft: supervised fine-tuning on "
        "`sft_data` (or the buffer's SFT stream when null); eval: one evaluation round, then exit.",
    )
    total_steps: int = Field(100, ge=1, description="The job ends (exit 0) after this step.")
    groups_per_step: int = Field(8, ge=1, description="Whole groups per optimizer batch.")
    micro_batch_tokens: int = Field(
        8192,
        ge=16,
        description="Token budget of one micro-batch (gradient accumulation): sequences are "
        "bucketed by length so that longest * count stays within it.",
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        0, description="DeepSpeed ZeRO stage (0 = plain data parallel)."
    )
    gradient_checkpointing: bool | Literal["selective"] = Field(
        False,
        description="Recompute activations in the backward pass. true: each decoder layer whole "
        "(least memory, ~20-30% slower); selective: the layer keeps the outputs of its matrix "
        "products and attention and recomputes only the elementwise work between them (norms, "
        "activations, rotary embeddings): roughly half the activation memory for a few "
        "percent more time (docs/trainer.md).",
    )
    logprob_chunk_size: int = Field(
        4096,
        ge=1,
        description="Vocabulary rows per chunk when computing logprobs and entropies, so that "
        "full [tokens, vocab] logits are never materialised.",
    )
    compile_model: bool = Field(
        False,
        description="torch.compile each decoder layer of the policy (regional compilation: "
        "one graph serves every layer) at start, to fuse the layers' norms, rotary embeddings "
        "and activations; ZeRO stages 0-2.",
    )
    compile_logprobs: bool = Field(
        False,
        description="Fuse the logprob head's per-chunk work with torch.compile (compiled once "
        "at start): on a GPU, one or two kernels per vocabulary chunk instead of a pass over "
        "fp32 [tokens, chunk] logits for every operation.",
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    max_staleness: int = Field(1, ge=-1, description="0 = strictly on-policy; -1 = unbounded.")
    batch_wait_seconds: float = Field(
        10.0, gt=0, description="How long one GetBatch call waits for a full batch."
    )
    publish_every: int = Field(
        1,
        ge=1,
        description="Publish weights when the policy version is a multiple of k; the current "
        "version is also published before each eval round and at the job's end, so evals and "
        "the engines' final weights are never behind.",
    )
    publish_weights: bool = Field(
        True, description="Publish to weight-sync (endpoints.weight_sync); off for SFT-only jobs."
    )
    checkpoint_every: int = Field(
        50,
        ge=0,
        description="Checkpoint every N steps (an RL job's SFT warm-up: every N of its own "
        "steps); 0: no periodic checkpoints. The job's end (total_steps reached, or the data "
        "ran out) always writes the final checkpoint (and its HF export), once; a graceful "
        "stop (SIGTERM) writes one only when N > 0. With 0 no batch is held "
        "(ack_after_checkpoint): each is acknowledged after its step, and a crash leaves the "
        "groups of every step since the last checkpoint (or the job's start) out of the final "
        "weights.",
    )
    ack_after_checkpoint: bool = Field(
        True,
        description="Hold each trained batch in the buffer until a checkpoint holds its step, "
        "and acknowledge it then: a trainer that dies between checkpoints trains those batches "
        "again from its checkpoint, so every group is in the final weights exactly once. The "
        "buffer keeps their groups meanwhile (up to checkpoint_every batches, in Redis, outside "
        "buffer.max_inflight_groups). False: acknowledge each batch right after its step; a "
        "crash then loses up to checkpoint_every - 1 steps of groups from the weights.",
    )
    checkpoint_dir: str = Field(
        "checkpoints", description="DeepSpeed checkpoints, job cursor and HF exports go here."
    )
    keep_checkpoints: int = Field(2, ge=1, description="Older checkpoints are deleted.")
    export_hf: bool = Field(
        True, description="Write an HF safetensors folder (hf/) inside each checkpoint."
    )
    resume: bool = Field(True, description="Resume from the latest checkpoint in checkpoint_dir.")
    eval_every: int = Field(
        0,
        ge=0,
        description="Evaluate at the start, every N steps, and at the end when the last step "
        "was not a multiple of N (0 = start and end only).",
    )
    eval_correct_threshold: float = Field(
        0.5, description="An eval sample counts as correct when its reward is >= this."
    )
    eval_timeout_seconds: float = Field(
        600.0, gt=0, description="Give up on an eval round's missing groups after this."
    )
    sft_data: str | None = Field(None, description="JSONL of prompt/response pairs (sft mode).")
    sft_steps: int = Field(0, ge=0, description="SFT warm-start steps before RL.")
    sft_batch_size: int = Field(32, ge=1, description="Sequences per SFT step.")
    linger_seconds: float = Field(
        2.0, ge=0, description="After the last step, keep answering GetStatus this long, then exit."
    )

    @model_validator(mode="after")
    def _compile_below_zero3(self) -> TrainerConfig:
        if self.compile_model and self.zero_stage == 3:
            raise ValueError(
                "trainer.compile_model needs zero_stage 0-2: ZeRO-3 gathers each layer's "
                "parameters in hooks inside the layers' forward and backward, which a compiled "
                "layer does not run as eager code does. Set compile_model: false, or a lower "
                "zero_stage"
            )
        return self


TransportName = Literal["nccl", "gloo", "cuda_ipc", "snapshot", "shm"]


class WeightSyncConfig(Section):
    """The weight-sync service (`kuberl.weight_sync`) and its clients (`kuberl.common.weights`).

    The trainer hands each version to the service (shared memory on the same host, else a
    checked gRPC upload) and returns; the service relays it to every engine over the first
    transport in `transports` that the engine also offers (see docs/weight-sync.md)."""

    server: ServerConfig = _server(50053, 9103)
    transports: list[TransportName] = Field(
        default_factory=lambda: list[TransportName](
            ["cuda_ipc", "nccl", "shm", "gloo", "snapshot"]
        ),
        description="Transports the relay offers engines, in order of preference; each is used "
        "only where it can work: cuda_ipc for an engine on the trainer's host and GPU (when the "
        "trainer exported CUDA IPC handles), nccl when `device` is a GPU and the engine has "
        "another one, shm for engines on the service's host; snapshot is always available for "
        "catch-up.",
    )
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description='Device of the relay\'s NCCL broadcasts ("cuda", "cuda:0"): each bucket is '
        "staged there from the service's memory. cpu: the relay sends no NCCL (engines get the "
        "next transport they offer; SGLang engines, which take only nccl, snapshot or, on the "
        "trainer's GPU, cuda_ipc, then load every version from a snapshot or by cuda_ipc). On "
        "Kubernetes the chart sets cuda, and gives the weight-sync pod a GPU, when rollout runs "
        "SGLang and nccl is in `transports`.",
    )
    bucket_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024 * 1024,
        description="Broadcast bucket size: tensors are packed back to back into buckets of at "
        "most this many bytes (a larger tensor travels alone), one broadcast per bucket.",
    )
    heartbeat_seconds: float = Field(
        2.0,
        gt=0,
        description="Heartbeat period the service tells each engine when it registers (a "
        "heartbeat is a long poll answered at once when an update is pending); an engine silent "
        "for heartbeat_seconds x missed_heartbeats is dropped from the pool.",
    )
    missed_heartbeats: int = Field(3, ge=1, description="Drop an engine after this many.")
    broadcast_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="An engine that has not received and loaded a version within this is timed "
        "out of that version (it catches up later by snapshot); nobody else waits for it.",
    )
    snapshot_chunk_bytes: int = Field(
        4 * 1024 * 1024,
        ge=64 * 1024,
        description="Chunk size of snapshot downloads when the engine asks for none (capped by "
        "the server's max_message_bytes less 64 KiB); each chunk is checked before it is used.",
    )
    snapshot_dir: str = Field(
        ".kuberl/snapshots",
        description="Where versions are kept when shm_dir is unusable (no /dev/shm).",
    )
    shm_dir: str = Field(
        "/dev/shm/kuberl-weight-sync",
        description="Shared-memory folder holding the retained versions (and where a trainer on "
        "the same host writes a version directly).",
    )
    retain_versions: int = Field(
        2, ge=1, description="Complete versions kept (older ones are deleted once superseded)."
    )
    max_version_bytes: int = Field(
        0,
        ge=0,
        description="Most bytes one version may have in the store: an upload is refused at the "
        "chunk that would cross it, before its manifest arrives. 0: the size of the store "
        "folder's filesystem / (retain_versions + 1), room for the versions kept and the one "
        "being written; a positive value caps that (the smaller of the two applies), for a "
        "folder allowed less than its filesystem holds. The chart sets it to "
        "weightSync.snapshotSizeLimit / (retain_versions + 1) unless the job sets it.",
    )
    advertise_host: str | None = Field(
        None,
        description="Address engines use to reach this service's broadcast groups (the pod IP "
        "on Kubernetes); null uses the host's name resolved, 127.0.0.1 as a last resort.",
    )
    notify_engines: bool = Field(
        True,
        description="Also push each update to the replica's RolloutService.NotifyWeightsUpdate "
        "(best effort; engines always learn of updates through their heartbeat).",
    )


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
    def _consistent(self) -> JobConfig:
        if self.trainer.algorithm.advantage in ("grpo", "drgrpo", "rloo") and (
            self.rollout.group_size < 2
        ):
            raise ValueError(
                f"rollout.group_size must be >= 2 for advantage "
                f"{self.trainer.algorithm.advantage!r} (got {self.rollout.group_size})"
            )
        return self

    @model_validator(mode="after")
    def _possible(self) -> JobConfig:
        """Combinations that are valid field by field but can never run."""
        r = self.rollout
        t = self.trainer
        if t.mode == "rl" and t.publish_weights and 0 <= t.max_staleness < t.publish_every - 1:
            # After step 1 the trainer is at v1, the engines at v0 until v{publish_every}: with a
            # smaller staleness bound every group is dropped as stale and the job never steps.
            raise ValueError(
                f"trainer.publish_every {t.publish_every} with trainer.max_staleness "
                f"{t.max_staleness}: between two publishes the engines fall up to "
                f"{t.publish_every - 1} versions behind, so every group they generate is dropped "
                "as stale and training stops; set max_staleness >= publish_every - 1 (or -1), or "
                "a smaller publish_every"
            )
        if self.buffer.dynamic_sampling and r.group_size < 2:
            raise ValueError(
                "buffer.dynamic_sampling with rollout.group_size 1: a group of one sample has no "
                "reward variance, so every group is dropped and training never starts; set "
                "group_size >= 2 or buffer.dynamic_sampling: false"
            )
        if (
            self.buffer.dynamic_sampling
            and r.sampling.temperature == 0
            and r.group_size > 1
            and r.rollout_function is None
        ):
            raise ValueError(
                "buffer.dynamic_sampling with rollout.sampling.temperature 0: greedy sampling "
                "gives every sample of a group the same response and reward, so every group is "
                "dropped and training never starts; set rollout.sampling.temperature > 0 (e.g. "
                "1.0) or buffer.dynamic_sampling: false"
            )
        local = self.job.local
        if "device" in local.model_fields_set and local.device == "cpu":
            # A CPU-only local run (`kuberl run` hides CUDA): GPU-only settings cannot work.
            fix = "or set job.local.device: cuda on a machine with a GPU"
            transports = set(self.weight_sync.transports)
            if transports and transports <= {"nccl", "cuda_ipc"}:
                raise ValueError(
                    f"weight_sync.transports {self.weight_sync.transports} needs GPUs but "
                    f"job.local.device is cpu: add gloo, shm or snapshot, {fix}"
                )
            engine = r.engine
            if isinstance(engine, TorchEngineConfig) and engine.device.startswith("cuda"):
                raise ValueError(
                    f"rollout.engine.device {engine.device!r} but job.local.device is cpu: set "
                    f"rollout.engine.device: cpu, {fix}"
                )
            if isinstance(engine, SGLangEngineConfig) and engine.launch:
                raise ValueError(
                    "rollout.engine.launch starts an SGLang server, which needs a GPU, but "
                    f"job.local.device is cpu: use rollout.engine.kind: torch, {fix}"
                )
            rm = self.reward.reward_model
            if rm is not None and rm.device.startswith("cuda"):
                raise ValueError(
                    f"reward.reward_model.device {rm.device!r} but job.local.device is cpu: set "
                    f"reward.reward_model.device: cpu, {fix}"
                )
        if (
            isinstance(r.engine, SGLangEngineConfig)
            and r.sampling.ignore_eos
            and r.sampling.stop_token_ids
        ):
            raise ValueError(
                "rollout.sampling.ignore_eos with stop_token_ids on the sglang engine: SGLang "
                "ignores the stop token ids too under ignore_eos (every sample would run to "
                "max_new_tokens); drop ignore_eos or the stop ids"
            )
        ws = self.weight_sync
        if isinstance(r.engine, SGLangEngineConfig) and "snapshot" not in ws.transports:
            # An SGLang engine takes a version by NCCL or from a snapshot on disk (CUDA IPC only
            # on the trainer's GPU, and catch-up is always a snapshot); the relay sends NCCL
            # only from a GPU (`device`) and otherwise falls back to snapshot.
            if "nccl" not in ws.transports:
                raise ValueError(
                    f"weight_sync.transports {ws.transports} names neither route SGLang engines "
                    "(rollout.engine.kind: sglang) take, nccl or snapshot: add nccl (with "
                    "weight_sync.device: cuda) or snapshot"
                )
            if ws.device == "cpu":
                raise ValueError(
                    f"weight_sync.transports {ws.transports} makes nccl the only route to SGLang "
                    "engines (rollout.engine.kind: sglang), but weight_sync.device is cpu and the "
                    "relay sends NCCL only from a GPU, so every version would reach them by "
                    "snapshot, which the list leaves out: set weight_sync.device: cuda (the Helm "
                    "chart then gives the weight-sync pod a GPU), or add snapshot to "
                    "weight_sync.transports"
                )
        return self

    def check_files(self, service: str) -> None:
        """Raise ConfigError unless the files `service` reads at start are here.

        `kuberl serve <service>` calls this before it binds a port, so a wrong path fails at
        once with the field that names it, instead of as a traceback deep in the start-up.
        `kuberl config check` does not: a job file is often checked away from the volumes its
        pods mount. Relative paths are taken from the working directory, as the services do.
        """
        problems: list[str] = []

        def need(field: str, path: str | None, what: str, fix: str) -> None:
            if path and not Path(path).exists():
                problems.append(f"{field}: {path} does not exist ({what}); {fix}")

        model_fix = (
            "mount the model there or fix the path, or set model.path: null to build a small "
            "model (model.build)"
        )
        if service in ("rollout", "trainer") and self.model.path:
            need(
                "model.path",
                str(Path(self.model.path) / "config.json"),
                "a Hugging Face model folder has config.json",
                model_fix,
            )
        tc = self.trainer
        if service == "trainer" and tc.sft_data and (tc.mode == "sft" or tc.sft_steps):
            need(
                "trainer.sft_data",
                tc.sft_data,
                "JSONL of prompt/response pairs",
                "fix the path, or set trainer.sft_data: null",
            )
        rm = self.reward.reward_model
        if service == "reward" and rm is not None and "rm" in self.reward.verifiers:
            need(
                "reward.reward_model.path",
                str(Path(rm.path) / "config.json"),
                "a Hugging Face sequence-classification folder",
                "mount it or fix the path",
            )
        if service == "buffer":
            for kind in ("train", "eval"):
                for i, ds in enumerate(getattr(self.data, kind)):
                    need(
                        f"data.{kind}[{i}].path",
                        ds.path,
                        "a .jsonl or .parquet file",
                        "fix the path (relative paths start at the working directory)",
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


SECTIONS = tuple(JobConfig.model_fields)


class ConfigError(ValueError):
    """The job file or an override is wrong; the message lists every problem by field path."""


def _set_path(data: dict[str, Any], path: list[str], value: Any, origin: str) -> None:
    node = data
    for key in path[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: {'.'.join(path)}: {key} is not a section")
        node = child
    node[path[-1]] = value


def env_overrides(env: Mapping[str, str]) -> list[tuple[list[str], Any, str]]:
    """The `KUBERL_<SECTION>__<FIELD>` variables in env as (path, parsed value, variable name)."""
    found = []
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
        if path[0] not in SECTIONS:
            raise ConfigError(
                f"environment {name}: unknown section {path[0]!r}; expected one of "
                f"{', '.join(SECTIONS)}"
            )
        text = _takes_a_string(path)
        if raw == "" or (text and not (text == "optional" and raw in ("null", "~"))):
            value: Any = raw  # as written: YAML would read 2024, no, or '#...' otherwise
        else:
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError as exc:
                problem = str(exc).splitlines()[0]
                raise ConfigError(
                    f"environment {name}: {'.'.join(path)}: not a YAML value ({problem}); quote it"
                ) from None
        found.append((path, value, name))
    return found


def _takes_a_string(path: list[str]) -> str:
    """ "text" when the field at `path` holds only text (str, a Literal of strings), "optional"
    for str | None (whose `null` or `~` stays None), else ""."""
    models: list[type[BaseModel]] = [JobConfig]
    annotation: Any = None
    for i, part in enumerate(path):
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if not fields:
            return ""
        annotation = fields[0].annotation
        if i < len(path) - 1:
            models = _models_in(annotation)
    if get_origin(annotation) is Literal:
        return "text" if all(isinstance(v, str) for v in get_args(annotation)) else ""
    args = get_args(annotation) or (annotation,)
    kinds = [a for a in args if a is not type(None)]
    if kinds != [str]:
        return ""
    return "optional" if type(None) in args else "text"


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, unions, lists, dicts)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _unknown_field_hint(loc: tuple[Any, ...]) -> str:
    """'; did you mean X?' (or the known names) for an unknown key at loc."""
    models: list[type[BaseModel]] = [JobConfig]
    for part in loc[:-1]:
        inner = [
            m
            for model in models
            if isinstance(part, str) and part in model.model_fields
            for m in _models_in(model.model_fields[part].annotation)
        ]
        if inner:
            models = inner
        elif isinstance(part, str):  # a discriminator tag (engine kind) or a dict key
            tagged = [
                m for m in models if getattr(m.model_fields.get("kind"), "default", 0) == part
            ]
            models = tagged or models
    known = sorted({name for model in models for name in model.model_fields})
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; known fields here: {', '.join(known)}" if known else ""


def _describe(err: dict[str, Any], origins: dict[str, str]) -> str:
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
    where = f" (from {origins[loc]})" if loc in origins else ""
    got = err.get("input")
    got_text = "" if err["type"] == "missing" or isinstance(got, dict) else f" (got {got!r})"
    hint = _unknown_field_hint(tuple(err["loc"])) if err["type"] == "extra_forbidden" else ""
    return f"{loc or '<job>'}: {err['msg']}{got_text}{hint}{where}"


def parse_job_config(
    data: Mapping[str, Any] | None,
    env: Mapping[str, str] | None = None,
    source: str = "<job>",
) -> JobConfig:
    """Validate a job document after applying env overrides; raise ConfigError on any problem."""
    if not isinstance(data, Mapping | type(None)):
        raise ConfigError(f"{source}: the job file must be a mapping of sections")
    doc: dict[str, Any] = copy.deepcopy(dict(data or {}))  # overrides never reach the caller's
    origins: dict[str, str] = {}
    for path, value, name in env_overrides(os.environ if env is None else env):
        _set_path(doc, path, value, f"environment {name}")
        origins[".".join(path)] = f"environment {name}"
    try:
        return JobConfig.model_validate(doc)
    except ValidationError as exc:
        lines = [_describe(dict(e), origins) for e in exc.errors()]
        raise ConfigError(
            f"{source}: invalid job configuration:\n  " + "\n  ".join(lines)
        ) from None


def load_job_config(path: str | Path | None, env: Mapping[str, str] | None = None) -> JobConfig:
    """Read a job YAML file (None: defaults only) and validate it with env overrides."""
    if path is None:
        return parse_job_config({}, env, "<defaults>")
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the job file: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(
            f"{p}: the job file must be a mapping of sections, got {type(data).__name__}"
        )
    return parse_job_config(data, env, str(p))


def dump_job_config(config: JobConfig) -> str:
    """The resolved job as YAML (what a run folder records)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
