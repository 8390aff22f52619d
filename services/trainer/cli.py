"""Trainer subcommands: `kuberl model init` builds a small model of a real architecture locally.

    kuberl model init --arch qwen2 --size tiny --tokenizer bpe --data train.jsonl OUT/

writes an ordinary Hugging Face folder (config, safetensors weights, a tokenizer trained on the
data with the `tokenizers` library, or a character tokenizer with `--tokenizer digits`), so jobs,
tests and the demo run without any download (`kuberl.common.modelbuild` does the work). A real
checkpoint folder is used the same way, through `model.path` in the job file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _texts(paths: list[str], limit: int) -> list[str]:
    texts: list[str] = []
    for path in paths:
        with open(path) as f:
            for i, line in enumerate(f):
                if limit and i >= limit:
                    break
                if not line.strip():
                    continue
                row = json.loads(line)
                texts.append("\n".join(str(v) for v in row.values() if isinstance(v, str)))
    return texts


def _cmd_model_init(args: argparse.Namespace) -> int:
    from kuberl.common.modelbuild import build_model

    if args.tokenizer == "bpe" and not args.data:
        raise SystemExit(
            "kuberl model init: --tokenizer bpe needs --data (the text to train it on)"
        )
    out = build_model(
        Path(args.out),
        arch=args.arch,
        size=args.size,
        tokenizer=args.tokenizer,
        corpus=_texts(args.data, args.limit),
        seed=args.seed,
    )
    info = json.loads((out / "kuberl_build.json").read_text())
    print(f"{out}: {info['arch']} {info['size']}, {info['parameters']:,} parameters")
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="build a small model locally (no download)")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="<action>")
    init = model_sub.add_parser("init", help="write a randomly initialised HF model folder")
    init.add_argument("out", help="output folder")
    init.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    init.add_argument("--size", choices=("tiny", "small"), default="tiny")
    init.add_argument(
        "--tokenizer",
        choices=("bpe", "digits"),
        default="bpe",
        help="bpe: byte-level BPE trained on --data; digits: one token per character",
    )
    init.add_argument(
        "--data", action="append", default=[], help="JSONL file(s) to train the tokenizer on"
    )
    init.add_argument("--limit", type=int, default=0, help="use only the first N rows per file")
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(func=_cmd_model_init)
