"""A trainer killed in the middle of an eval round, once restarted, evaluates a whole round.

Trainer 1 (`kuberl serve trainer`, `mode: eval`, a real process on a real buffer) reads and
acknowledges one of round 0's two groups and is SIGKILLed; the other group arrives after. Round 0
can never be whole again, so trainer 2 must not wait `eval_timeout_seconds` for it and report
half the eval set: it runs a fresh round (1) over every eval prompt, answered here as rollout
would answer them.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest

from kuberl.api.common.v1 import trajectory_pb2 as tpb
from kuberl.common.redis_server import EmbeddedRedis
from kuberl.local.accounting import read_rows
from tests.integration.buffer_support import Client, start_buffer, write_job
from tests.integration.test_trainer_rl import EVAL_REWARDS, _group, _until_exit
from tests.reliability.test_exactly_once import _trainer_job, _wait
from tests.support import ServiceProcess

EVAL = tpb.STREAM_KIND_EVAL
# Long enough for trainer 2 to read a fresh round; a trainer that waits for round 0 instead
# gives up after it with one group of two.
EVAL_TIMEOUT_SECONDS = 30.0


@pytest.mark.slow
def test_a_trainer_killed_mid_eval_round_evaluates_a_fresh_whole_round_once_restarted(
    tmp_path: Path,
) -> None:
    from kuberl.common.modelbuild import build_model

    model = build_model(tmp_path / "model", tokenizer="digits", seed=2)
    metrics = tmp_path / "metrics-2.jsonl"
    with EmbeddedRedis(tmp_path / "redis", die_with_parent=True) as redis_server:
        base = write_job(
            tmp_path, redis_server.url, prompts=4, eval_prompts=2, job=f"ev{uuid.uuid4().hex[:8]}"
        )
        with start_buffer(base, tmp_path) as buffer, Client(buffer.address) as client:
            job = _trainer_job(
                tmp_path,
                base,
                model,
                buffer.address,
                "eval.yaml",
                mode="eval",
                eval_timeout_seconds=EVAL_TIMEOUT_SECONDS,
            )
            first_half, second_half = client.lease(2, kind=tpb.STREAM_KIND_EVAL).prompts
            client.put([_group(first_half, EVAL_REWARDS, 1)], [first_half.lease_id], kind=EVAL)
            first = ServiceProcess.kuberl("trainer", job, tmp_path, name="trainer-1")
            try:
                _wait(
                    lambda: client.stats().counters.get("eval:acked_batches", 0) >= 1,
                    240,
                    "eval batch acknowledged",
                    first,
                )
                os.killpg(first.proc.pid, signal.SIGKILL)
                first.proc.wait(30)
            finally:
                first.stop()
            client.put([_group(second_half, EVAL_REWARDS, 2)], [second_half.lease_id], kind=EVAL)
            env = {"KUBERL_METRICS_JSONL": str(metrics)}
            second = ServiceProcess.kuberl("trainer", job, tmp_path, name="trainer-2", env=env)
            _, code, log = _until_exit(client, second, 240)
    rows = read_rows(metrics)
    evals = [(r["round"], r["eval/groups"], r["eval/missing_groups"]) for r in rows]
    assert (code, evals) == (0, [(1, 2.0, 0.0)]), log[-3000:]
