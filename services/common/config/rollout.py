"""The `rollout` section: engines, sampling and multi-turn tool calling."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from kuberl.common.config.base import Section, ServerConfig, server_field
from kuberl.common.config.sandbox import SandboxConfig


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
    seed: int | None = Field(
        None,
        description="Seed of the sampling generator (null: job.seed), mixed with the replica "
        "id: each replica samples its own draws, reproducibly.",
    )
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


#: The modules sglang 0.5.23 can put LoRA adapters on (`SUPPORTED_LORA_TARGET_MODULES` in
#: sglang/srt/utils/common.py, the choices of --lora-target-modules); the contract test reads them.
SGLANG_LORA_TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj",
    "kv_b_proj", "wq_b", "wk", "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
    "gate_up_proj", "embed_tokens", "lm_head", "qkvr", "wo_ud",
)  # fmt: skip


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


class SimulatedEngineConfig(Section):
    """A benchmark engine without a model (`kuberl.rollout.engine.simulated`): random tokens at a
    set rate and length distribution, so one process can host many replicas' engines."""

    kind: Literal["simulated"] = "simulated"
    tokens_per_second: float = Field(
        200.0, gt=0, description="Decode rate of every sequence (sequences run in parallel)."
    )
    response_tokens: int = Field(256, ge=1, description="Median response length (tokens).")
    length_sigma: float = Field(
        0.5, ge=0, description="Log-normal spread of response lengths (0: all the same)."
    )
    vocab_size: int = Field(32_000, ge=2, description="Token ids are drawn below this.")
    seed: int | None = Field(
        None,
        description="Seed of the draws (null: job.seed), mixed with the replica id: each "
        "replica draws its own lengths, reproducibly.",
    )


def _engine_kind(value: Any) -> str:
    """The engine section's `kind`, `torch` when left out, so that an engine section without it
    (`{max_batch_size: 4}`, or KUBERL_ROLLOUT__ENGINE__DEVICE alone) is the default engine."""
    kind = value.get("kind", "torch") if isinstance(value, dict) else getattr(value, "kind", "")
    return str(kind)


EngineConfig = Annotated[
    Annotated[TorchEngineConfig, Tag("torch")]
    | Annotated[SGLangEngineConfig, Tag("sglang")]
    | Annotated[SimulatedEngineConfig, Tag("simulated")],
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
    server: ServerConfig = server_field(50060, 9110)
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
    peer_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port a replica serves the weight versions it holds to other replicas on "
        "(weight-sync's relay tree, `weight_sync.relay_fanout` > 0; torch engines). 0: any "
        "free port; the chart fixes it so that its NetworkPolicy can open it to rollout pods "
        "only.",
    )
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
