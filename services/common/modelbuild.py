"""Small models of real architectures, built locally so jobs, tests and the demo need no download.

`build_model` writes an ordinary Hugging Face folder (config.json, model.safetensors, tokenizer
files) for a Qwen2- or Llama-architecture causal LM with random weights, and a real tokenizer:
`digits` is a character-level tokenizer over printable ASCII (enough for arithmetic and any
English text, one token per character), `bpe` is a byte-level BPE trained on the job's training
text with the `tokenizers` library. `resolve_model` is what trainer and rollout call: the job's
`model.path` when set (a local folder, or a hub id fetched by `kuberl.common.hub`), else a
folder built once into a cache keyed by everything that determines its content, so every
process of a job loads the same weights. A real checkpoint path works the
same way; nothing here is specific to the tiny models. `load_tokenizer` is how every service
loads a folder's tokenizer (it is exactly the one saved, which `AutoTokenizer` alone does not
guarantee).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import string
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kuberl.common import hub
from kuberl.common.config import DatasetConfig, JobConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = "<|endoftext|>"

# Architecture sizes. tiny is about 1M parameters with the char tokenizer, small about 10M.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "small": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
}
BPE_VOCAB = {"tiny": 2048, "small": 8192}
MAX_POSITIONS = 2048
BUILD_INFO = "kuberl_build.json"


def build_tokenizer(kind: str, corpus: Iterable[str] = (), vocab_size: int = 2048) -> Any:
    """A `PreTrainedTokenizerFast` of the given kind (`digits` or `bpe`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "digits":
        chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
        vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, "<unk>", *chars])}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        unk: str | None = "<unk>"
    elif kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(list(corpus), trainer=trainer)
        unk = None
    else:
        raise ValueError(f"tokenizer kind {kind!r}; expected 'digits' or 'bpe'")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        bos_token=None,
        unk_token=unk,
        clean_up_tokenization_spaces=False,
    )


# tokenizer_config.json classes that mean "tokenizer.json says it all".
GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a local model folder, exactly as its files define it.

    transformers 5 overrides the folder's declared `tokenizer_class` for some model types (qwen2
    among them: its `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`) and `Qwen2Tokenizer` then builds
    its own byte-level pipeline around the vocabulary instead of reading tokenizer.json: the
    `digits` tokenizer of a Qwen2 folder built here silently lost every space and newline
    ("What is 1 plus 1?" became "Whatis1plus1?" in every service). A folder whose
    tokenizer_config.json declares the generic fast class (what `build_tokenizer` saves) is loaded
    with that class, which takes tokenizer.json as written; any other folder, and anything that is
    not a folder, goes through `AutoTokenizer`. Nothing is downloaded.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = Path(path)
    declared = None
    if (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file():
        declared = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    if declared in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def build_model(
    out_dir: str | Path,
    *,
    arch: str = "qwen2",
    size: str = "tiny",
    tokenizer: str = "digits",
    corpus: Sequence[str] = (),
    seed: int = 0,
) -> Path:
    """Write a randomly initialised HF model + tokenizer folder to out_dir and return it."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if size not in SIZES:
        raise ValueError(f"model size {size!r}; expected one of {', '.join(SIZES)}")
    if tokenizer == "bpe" and not corpus:
        raise ValueError("a bpe tokenizer needs a training corpus (the job's training data)")
    tok = build_tokenizer(tokenizer, corpus, BPE_VOCAB[size])
    dims = SIZES[size]
    common = {
        **dims,
        "vocab_size": len(tok),
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": True,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.eos_token_id,
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config: Any = Qwen2Config(**common)
    elif arch == "llama":
        config = LlamaConfig(**common)
    else:
        raise ValueError(f"architecture {arch!r}; expected 'qwen2' or 'llama'")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    info = {
        "arch": arch,
        "size": size,
        "tokenizer": tokenizer,
        "seed": seed,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / BUILD_INFO).write_text(json.dumps(info, indent=2))
    return out


def _dataset_texts(dataset: DatasetConfig, base: Path) -> list[str]:
    """Prompt and answer texts of a training dataset (JSONL or Parquet, read as the buffer
    reads it: blank lines skipped, `limit` rows), the BPE tokenizer's corpus."""
    from kuberl.common.datasets import read_dataset

    path = Path(dataset.path).expanduser()
    path = path if path.is_absolute() or not (base / path).exists() else base / path
    c = dataset.columns
    rows = read_dataset(
        path,
        prompt=c.prompt,
        answer=c.answer,
        metadata=[],
        limit=dataset.limit,
        split=dataset.split,
        subset=dataset.subset,
        revision=dataset.revision,
    )
    return [f"{row.text}\n{row.answer}" for row in rows]


def _cache_key(config: JobConfig, corpus_files: list[str]) -> str:
    spec = {
        "build": config.model.build.model_dump(),
        "seed": config.job.seed,
        "corpus": corpus_files if config.model.build.tokenizer == "bpe" else [],
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def resolve_model(
    config: JobConfig, cache_dir: str | Path = ".kuberl/models", base_dir: str | Path = "."
) -> Path:
    """The model folder of a job: `model.path`, or a cached build of `model.build`.

    Relative paths (the cache, dataset files) are taken from base_dir. Several processes may call
    this at once: the build happens under a file lock and appears atomically.
    """
    base = Path(base_dir)
    if config.model.path:
        return hub.resolve_model(config.model.path, config.model.revision, "model.path", base)
    files = []
    for ds in config.data.train:
        p = Path(ds.path) if Path(ds.path).is_absolute() else base / ds.path
        where = f"{p.resolve()}:{p.stat().st_size}" if p.exists() else f"{ds.path}@{ds.revision}"
        files.append(
            f"{where}:{ds.subset}:{ds.split}:{ds.limit}:{ds.columns.prompt}:{ds.columns.answer}"
        )
    cache = Path(cache_dir) if Path(cache_dir).is_absolute() else base / cache_dir
    target = cache / _cache_key(config, files)
    if (target / BUILD_INFO).exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / BUILD_INFO).exists():
            return target
        corpus: list[str] = []
        if config.model.build.tokenizer == "bpe":
            for ds in config.data.train:
                corpus += _dataset_texts(ds, base)
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".build-"))
        try:
            b = config.model.build
            build_model(
                tmp,
                arch=b.arch,
                size=b.size,
                tokenizer=b.tokenizer,
                corpus=corpus,
                seed=config.job.seed,
            )
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
