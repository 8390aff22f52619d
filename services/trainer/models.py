"""The models one trainer process trains and reads: the policy, the PPO critic, the frozen KL
reference, and the tokenizer, built from the job's model as DeepSpeed engines on every rank.

With `model.lora` the policy (and the critic's backbone) carry PEFT adapters injected in place
(`kuberl.common.lora`) and only the adapters (and the critic's value head) train; the KL
reference is then the policy with its adapters off, not a second copy of the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kuberl.common import lora
from kuberl.common.config import JobConfig, LoraConfig
from kuberl.trainer import algorithms as algo
from kuberl.trainer.distributed import DistInfo
from kuberl.trainer.engine import (
    AdaptersOffReference,
    FrozenModel,
    TrainEngine,
    ValueModel,
    build_policy,
    enable_activation_checkpointing,
    load_causal_lm,
    train_dtype,
)


def head_temperature(config: JobConfig) -> float:
    """The temperature the policy head divides logits by: the rollout's, as the engine's
    logprobs are (an RL job's SFT warm-up so fits what its engines will sample), except in
    `mode: sft`, which fits the model itself (its export is sampled at any temperature): 1."""
    if config.trainer.mode == "sft":
        return 1.0
    return config.rollout.sampling.temperature or 1.0


@dataclass
class Models:
    """Empty until `load`; the steps, checkpoints and publishes read it."""

    policy: TrainEngine | None = None
    #: The value model of an advantage estimator that needs a critic (GAE), rl mode.
    critic: TrainEngine | None = None
    #: The frozen reference policy of the KL term (`kl.coef` > 0, rl mode).
    reference: FrozenModel | AdaptersOffReference | None = None
    tokenizer: Any = None
    model_dir: Path = field(default_factory=Path)
    pad_id: int = 0
    #: The input embedding is the output head (the HF export writes it once).
    tied: bool = False
    vocab_size: int = 0

    @property
    def engine(self) -> TrainEngine:
        assert self.policy is not None, "Models.load builds the policy first"
        return self.policy

    def load_tokenizer(self, config: JobConfig, base_dir: Path) -> None:
        """Find the job's model (built here when the job asks for a local one) and load its
        tokenizer."""
        from kuberl.common.modelbuild import load_tokenizer, resolve_model

        self.model_dir = resolve_model(config, base_dir=base_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id or 0)

    def load(self, config: JobConfig, dist: DistInfo) -> None:
        """Load the model(s) of `load_tokenizer`'s folder and build their engines. Collective."""
        tc = config.trainer
        dtype = train_dtype(config.model, dist.device)
        temperature = head_temperature(config)
        adapters = config.model.lora
        hf = self._load_hf(dtype, adapters)
        self.tied = bool(getattr(hf.config, "tie_word_embeddings", False))
        self.vocab_size = int(hf.get_input_embeddings().weight.shape[0])
        enable_activation_checkpointing(hf, tc.gradient_checkpointing)
        self.policy = TrainEngine(build_policy(hf, tc, temperature), tc, dist, dtype)
        alg = tc.algorithm
        if alg.kl.coef > 0 and tc.mode == "rl":
            if adapters is not None:
                self.reference = AdaptersOffReference(self.policy)
            else:
                # The policy's own build (head settings, compiled layers), frozen.
                ref = build_policy(load_causal_lm(self.model_dir, dtype), tc, temperature)
                self.reference = FrozenModel(ref, tc, dist, dtype, offload=alg.kl.offload_reference)
        if algo.resolve_algorithm(alg).needs_critic and tc.mode == "rl":
            # With LoRA the critic has adapters of its own over its own copy of the base (a
            # value head on the policy's would need one engine for two optimizers).
            backbone = self._load_hf(dtype, adapters).get_decoder()
            critic = ValueModel(backbone, int(hf.config.hidden_size))
            self.critic = TrainEngine(critic, tc, dist, dtype)

    def _load_hf(self, dtype: Any, adapters: LoraConfig | None) -> Any:
        """The job's HF model, with `model.lora`'s adapters injected (only they train)."""
        hf = load_causal_lm(self.model_dir, dtype)
        if adapters is None:
            return hf
        head = {n for n, m in hf.named_modules() if m is hf.get_output_embeddings()}
        clash = sorted({n.rsplit(".", 1)[-1] for n in head} & set(adapters.target_modules))
        if clash:
            raise ValueError(
                f"model.lora.target_modules {clash}: the output layer cannot carry adapters "
                "(the trainer's logprob head computes hidden @ W^T with the base weight); "
                "leave it out"
            )
        return lora.inject(hf, adapters)
