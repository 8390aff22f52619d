"""A reward worker process: runs CPU-bound verifiers for `kuberl.reward.pool`.

Started as `python -m kuberl.reward.worker`. The first line on stdin is the job configuration
(JSON); the worker loads the verifiers it names, answers `{"ready": true}`, then handles one
chunk per line, `{"items": [{"i": 7, "verifiers": ["gsm8k", "format"], "sample": {...}}, ...]}`,
answering one line per sample, `{"i": 7, "results": {"gsm8k": {"score": 1.0, ...}, ...}}`.
When a sample asks for several verifiers, a `{"i": 7, "running": "format"}` line precedes each,
so that a pool which has to kill a hung worker knows which verifier hung. Lines are flushed at
least every 50 ms while a chunk runs (the pool reads them as progress) and at its end; a chunk of
one sample is flushed line by line.

The protocol uses private copies of the original stdin/stdout; file descriptors 0 and 1 are
pointed at /dev/null and stderr, so a verifier that prints or reads cannot corrupt it. A verifier
that raises produces an error result; one that hangs is killed with the whole worker.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from kuberl.common.config import JobConfig
from kuberl.common.logs import get_logger, setup_logging
from kuberl.reward.sample import RewardSample
from kuberl.reward.verifiers import Verdict, VerifierFailure, as_verdict

log = get_logger(__name__)

PoolFunction = Callable[[RewardSample], Any]
FLUSH_SECONDS = 0.05


def pool_functions(job: JobConfig) -> dict[str, PoolFunction]:
    """Every verifier the worker can run: the built-in pool verifiers and custom sync ones."""
    from kuberl.reward.verifiers import custom, format, gsm8k, math_answer

    functions: dict[str, PoolFunction] = {
        "gsm8k": gsm8k.score,
        "math": math_answer.score,
        "format": functools.partial(format.format_score, job.reward.format_pattern),
        "regex": format.regex_score,
    }
    for name, spec in job.reward.custom.items():
        fn = custom.load(name, spec)
        if not custom.is_async(fn):
            functions[name] = fn
    return functions


def preload(names: list[str]) -> None:
    """Import heavy libraries now, so the first sample's timeout does not pay for them."""
    if "math" in names:
        import math_verify  # noqa: F401


def run_one(fn: PoolFunction, name: str, sample: RewardSample) -> dict[str, Any]:
    """One verifier on one sample, as a JSON-ready result (score or error)."""
    started = time.perf_counter()
    try:
        verdict: Verdict = as_verdict(fn(sample), name)
    except VerifierFailure as exc:
        return {"error": exc.reason, "message": exc.message}
    except Exception as exc:
        return {"error": "exception", "message": f"{type(exc).__name__}: {exc}"[:500]}
    return {
        "score": verdict.score,
        "extras": verdict.extras,
        "details": verdict.details,
        "seconds": time.perf_counter() - started,
    }


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    job = JobConfig.model_validate_json(inp.readline())
    functions = pool_functions(job)
    preload(list(job.reward.verifiers))
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in inp:
        items = json.loads(line)["items"]
        # Alone, a sample's lines go out at once (the pool is looking for the verifier that
        # hangs); in a chunk they are written at least every FLUSH_SECONDS, and at its end.
        eager = len(items) == 1
        last_flush = time.monotonic()
        for item in items:
            rid, names = item["i"], item["verifiers"]
            sample = RewardSample.from_json(item["sample"])
            results = {}
            for name in names:
                if len(names) > 1:
                    out.write(json.dumps({"i": rid, "running": name}).encode() + b"\n")
                    if eager:
                        out.flush()
                fn = functions.get(name)
                if fn is None:
                    results[name] = {"error": "exception", "message": f"unknown verifier {name!r}"}
                else:
                    results[name] = run_one(fn, name, sample)
            out.write(json.dumps({"i": rid, "results": results}).encode() + b"\n")
            if eager or time.monotonic() - last_flush > FLUSH_SECONDS:
                out.flush()
                last_flush = time.monotonic()
        out.flush()


def main() -> None:
    from kuberl.common.sandbox import protect_process

    setup_logging("reward-worker")
    protect_process()
    inp = os.fdopen(os.dup(0), "rb")
    out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):
        serve(inp, out)


if __name__ == "__main__":
    main()
