"""Sharp tiny models of a real architecture, built locally, for the rollout engine's tests:
modelbuild's random initialisation gives near-uniform next-token distributions, so greedy decoding
repeats one character and samples look alike; these are the same Qwen2 on modelbuild's `digits`
tokenizer with an untied, 10x output layer (entropy ~3.5 nats), saved as an ordinary HF folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def build_tokenizer() -> Any:
    """modelbuild's character tokenizer, with a ChatML chat template for prompt tests."""
    from kuberl.common.modelbuild import build_tokenizer as common_tokenizer

    tokenizer = common_tokenizer("digits")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_model(
    tokenizer: Any,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 1024,
    seed: int = 0,
) -> Any:
    """A randomly initialised Qwen2ForCausalLM sized for the tokenizer (deterministic per seed)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    eos = tokenizer.eos_token_id
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    # Random init gives near-uniform logits (entropy ~log V); a 10x output layer brings the
    # entropy to ~3.5 nats, so greedy decoding has no near-ties and samples differ.
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model.eval()


def save_tiny_model(path: str | Path, *, seed: int = 0, **model_kw: Any) -> Path:
    """Build the tokenizer and a tiny Qwen2 and save both as an HF folder at `path`."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed, **model_kw)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
