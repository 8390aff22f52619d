"""The `rm` verifier: a Hugging Face sequence-classification reward model, scored in batches.

The model and tokenizer are loaded once from the job's `reward.reward_model.path` (a local
folder, never downloaded) when the service starts. Each (prompt, response) is formatted as a
user/assistant chat with the tokenizer's chat template when it has one (else the two texts are
concatenated), tokenized with the left end cut at `max_length` (the response's end matters most),
and padded into batches of `batch_size`. The score is the model's single logit at the last
non-padding token (`num_labels` must be 1, as for Skywork-Reward or an RLHF-trained RM).

Calls run in a thread (torch releases the GIL), one batch at a time under a lock, so the event
loop keeps serving while the model works.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kuberl.common.config import RewardModelConfig
from kuberl.common.logs import get_logger

log = get_logger(__name__)


class RewardModel:
    """A loaded reward model; `score` maps (prompt, response) pairs to floats."""

    def __init__(self, config: RewardModelConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._model: Any = None
        self._tokenizer: Any = None

    def load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        from kuberl.common.hub import resolve_model
        from kuberl.common.modelbuild import load_tokenizer

        path = str(
            resolve_model(self.config.path, self.config.revision, "reward.reward_model.path")
        )
        tokenizer = load_tokenizer(path)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=True, torch_dtype=torch.float32
        )
        if model.config.num_labels != 1:
            raise ValueError(
                f"reward model {path}: num_labels is {model.config.num_labels}; a reward model "
                "has one output (num_labels=1)"
            )
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        tokenizer.truncation_side = "left"
        tokenizer.padding_side = "right"
        self._model = model.to(self.config.device).eval()
        self._tokenizer = tokenizer
        log.info("reward_model.loaded", path=path, device=self.config.device)

    def format(self, prompt: str, response: str) -> str:
        """The text the model reads for one sample."""
        tok = self._tokenizer
        if self.config.chat_template and getattr(tok, "chat_template", None):
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": response},
            ]
            return str(tok.apply_chat_template(messages, tokenize=False))
        return prompt + response

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """Scores of (prompt, response) pairs, computed `batch_size` at a time."""
        import torch

        if self._model is None:
            raise RuntimeError("reward model is not loaded")
        texts = [self.format(p, r) for p, r in pairs]
        scores: list[float] = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(texts), self.config.batch_size):
                batch = self._tokenizer(
                    texts[start : start + self.config.batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=self.config.max_length,
                ).to(self.config.device)
                logits = self._model(**batch).logits  # [B, 1]
                scores.extend(logits[:, 0].float().cpu().tolist())
        return scores
