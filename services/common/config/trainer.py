"""The `trainer` section: DeepSpeed, the training loop, checkpoints and modes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kuberl.common.config.algorithm import AlgorithmConfig
from kuberl.common.config.base import Section, ServerConfig, server_field


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

    server: ServerConfig = server_field(50054, 9104)
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
