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
    chat_template: bool = Field(
        False, description="Apply the tokenizer's chat template to prompts before generation."
    )
