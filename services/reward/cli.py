"""`kuberl reward ...`: check verifiers on your own data without a cluster.

    kuberl reward score --verifier gsm8k [--verifier length=0.5] [--config job.yaml] < in.jsonl
    kuberl reward verifiers [--config job.yaml]

`score` reads one JSON object per line on stdin, with keys `response` (required), `answer`,
`prompt`, `metadata` (object), `response_token_ids` (list of ints), `finish_reason` and `id`
(or `sample_id`), scores them with the same `Scorer` the service runs (worker processes,
sandbox, timeouts and fallbacks included) and writes one JSON line per input line, in order:
`{"id": ..., "reward": 1.0, "breakdown": {...}, "error": "", "details": "..."}`. A line that is
not a valid sample gets `{"line": N, "error": "..."}` and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

SAMPLE_KEYS = {
    "sample_id",
    "prompt",
    "response",
    "answer",
    "metadata",
    "response_token_ids",
    "finish_reason",
}


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    reward = subparsers.add_parser("reward", help="reward verifiers on local data")
    sub = reward.add_subparsers(dest="reward_command", required=True, metavar="<action>")
    score = sub.add_parser(
        "score", help="score JSONL samples from stdin; one JSON result per line on stdout"
    )
    score.add_argument(
        "--verifier",
        "-v",
        action="append",
        required=True,
        help="verifier name, or name=weight; repeat to combine several",
    )
    score.add_argument("--config", "-c", help="job YAML file (for limits and custom verifiers)")
    score.add_argument("--batch-size", type=int, default=256, help="lines scored together")
    score.set_defaults(func=_cmd_score)
    listing = sub.add_parser("verifiers", help="list the verifiers a job can use")
    listing.add_argument("--config", "-c", help="job YAML file")
    listing.set_defaults(func=_cmd_verifiers)


def _parse_line(line: str) -> Any:
    """A RewardSample from one input line; ValueError says what is wrong."""
    from kuberl.reward.sample import RewardSample

    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("each line must be a JSON object")
    if "id" in data:
        data["sample_id"] = str(data.pop("id"))
    unknown = set(data) - SAMPLE_KEYS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}; expected some of {sorted(SAMPLE_KEYS)}")
    if not isinstance(data.get("response"), str):
        raise ValueError("'response' (a string) is required")
    return RewardSample.from_json(data)


async def _score_stream(args: argparse.Namespace, source: TextIO, sink: TextIO) -> int:
    from kuberl.common.config import load_job_config
    from kuberl.common.errors import InvalidArgument
    from kuberl.reward.scorer import Scorer

    scorer = Scorer(load_job_config(args.config))
    try:
        combo = scorer.combination(args.verifier)
    except InvalidArgument as exc:
        print(f"kuberl: {exc.message}", file=sys.stderr)
        return 2
    await scorer.start()
    status = 0
    try:
        batch: list[tuple[int, Any]] = []

        async def flush() -> None:
            samples = [s for _, s in batch if not isinstance(s, str)]
            results = iter(await scorer.score(samples, [combo] * len(samples)))
            for number, sample in batch:
                if isinstance(sample, str):
                    out: dict[str, Any] = {"line": number, "error": sample}
                else:
                    r = next(results)
                    out = {"id": r.sample_id} if r.sample_id else {}
                    out |= {"reward": r.reward, "breakdown": r.breakdown, "error": r.error}
                    out["details"] = r.details
                sink.write(json.dumps(out) + "\n")
            sink.flush()
            batch.clear()

        for number, line in enumerate(source, start=1):
            if not line.strip():
                continue
            try:
                batch.append((number, _parse_line(line)))
            except ValueError as exc:
                batch.append((number, str(exc)))
                status = 1
            if len(batch) >= args.batch_size:
                await flush()
        await flush()
    finally:
        await scorer.stop()
    return status


def _cmd_score(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from kuberl.common.logs import setup_logging

    setup_logging("reward", level=os.environ.get("KUBERL_LOG_LEVEL", "warning"))
    return asyncio.run(_score_stream(args, sys.stdin, sys.stdout))


def _cmd_verifiers(args: argparse.Namespace) -> int:
    from kuberl.common.config import load_job_config
    from kuberl.reward.verifiers import BUILTINS

    config = load_job_config(args.config).reward
    rows = [(name, v.description) for name, v in BUILTINS.items()]
    rows += [(name, spec.description or spec.function) for name, spec in config.custom.items()]
    for name, description in rows:
        weight = config.verifiers.get(name)
        shown = f"weight {weight:g}" if weight is not None else "not in the job's combination"
        print(f"{name:10} {shown:30} {description}")
    return 0
