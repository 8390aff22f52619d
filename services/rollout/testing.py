"""Tiny models of a real architecture, built locally, for the rollout engine's tests and benchmark.

No weights can be downloaded here, so tests and `benchmarks/rollout_engine.py` build a random
Qwen2 causal LM (hidden 64, 2 layers by default) with a character-level tokenizer made with the
`tokenizers` library, and save both as an ordinary HF folder that any HF-loading code (and the
torch engine) opens with `from_pretrained`. The tokenizer knows the chat markers and the
`<tool_call>` / `<tool_response>` markers of kuberl's multi-turn format as single tokens, and has
a ChatML chat template. Jobs get their models from `kuberl.common.modelbuild`; this module only
exists so the engine can be tested without depending on it.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKER_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def build_tokenizer() -> Any:
    """A character-level PreTrainedTokenizerFast: every printable ASCII character is a token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(string.digits + string.ascii_letters + string.punctuation + " \n")
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *MARKER_TOKENS, *chars, "<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(MARKER_TOKENS)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


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
