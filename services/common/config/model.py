"""The `model` section: the policy's weights, or the small model built locally."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kuberl.common.config.base import Section


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


#: Every linear layer of a Qwen2/Llama decoder block: what LoRA trains unless the job says less.
DECODER_LINEAR_LAYERS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


class LoraConfig(Section):
    """Low-rank adapters (PEFT's LoRA): the trainer trains only these, weight-sync moves only
    these, and the rollout engines apply them over the unchanged base model."""

    rank: int = Field(16, ge=1, le=1024, description="The adapters' rank r.")
    alpha: int = Field(
        32, ge=1, description="Scaling numerator: an adapter's update is scaled by alpha / r."
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(DECODER_LINEAR_LAYERS),
        min_length=1,
        description="Names (last dotted part) of the linear layers that get adapters.",
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapters' input while training. Above 0 the trainer's "
        "logprobs no longer match the engines' (PPO ratios drift): keep 0 for RL.",
    )
    export_merged: bool = Field(
        False,
        description="Each checkpoint's export (`trainer.export_hf`) also writes the base model "
        "with the adapters merged in (`merged/`, an ordinary HF folder), besides the adapter "
        "itself (`adapter/`, PEFT's format), which it always writes.",
    )


class ModelConfig(Section):
    path: str | None = Field(
        None,
        description="Local HF model folder (weights + tokenizer), or a Hugging Face hub id "
        "(`Qwen/Qwen2.5-0.5B-Instruct`) fetched once into the HF cache (HF_HOME, token from "
        "HF_TOKEN). Null builds one (`build`).",
    )
    revision: str | None = Field(
        None, description="Branch, tag or commit of a hub id in `path` (default: main)."
    )
    build: BuildModelConfig = Field(default_factory=BuildModelConfig)
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Training and rollout dtype (float32 on CPU)."
    )
    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters instead of every weight (null: full training)."
    )
    chat_template: bool = Field(
        False, description="Apply the tokenizer's chat template to prompts before generation."
    )
