"""An eval round run after the newest checkpoint, against `kuberl serve buffer`.

A checkpoint is written before its step's eval round. If the trainer dies after the round and
before the next checkpoint, the resumed trainer would ask for the same round again, whose groups
it already read and acknowledged: it would wait `eval_timeout_seconds` and report accuracy 0.
So once a round's groups are read, the round is recorded in the newest checkpoint's cursor. The
trainer here is the real `Trainer` without a model (its eval needs only the buffer); the test
plays rollout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from kuberl.api.common.v1 import trajectory_pb2 as tpb
from kuberl.common.config import parse_job_config
from kuberl.common.redis_server import EmbeddedRedis
from kuberl.trainer import checkpoint as ckpt
from kuberl.trainer.distributed import DistInfo
from kuberl.trainer.loop import Trainer
from tests.integration.buffer_support import (
    GROUP_SIZE,
    Client,
    group_for,
    start_buffer,
    write_job,
)

EVAL = tpb.STREAM_KIND_EVAL


@pytest.fixture
def buffer(tmp_path: Path) -> Iterator[tuple[Client, Path]]:
    with EmbeddedRedis(tmp_path / "redis", die_with_parent=True) as redis:
        job = write_job(tmp_path, redis.url, prompts=4, eval_prompts=4)
        doc = yaml.safe_load(job.read_text())
        doc["trainer"] = {"eval_timeout_seconds": 20}
        job.write_text(yaml.safe_dump(doc))
        with start_buffer(job, tmp_path) as svc, Client(svc.address) as client:
            yield client, job


def _answer_eval_prompts(client: Client, stop: threading.Event, rewards: list[float]) -> None:
    """Rollout for the eval stream: one group per leased prompt, with these rewards."""
    while not stop.is_set():
        prompts = list(client.lease(8, consumer="eval-r0", kind=EVAL).prompts)
        if prompts:
            groups = [group_for(p, rewards=rewards) for p in prompts]
            client.put(groups, [p.lease_id for p in prompts], kind=EVAL)
        else:
            stop.wait(0.05)


def _trainer(job: Path, client: Client, checkpoint: Path) -> Trainer:
    """A trainer whose newest checkpoint is `checkpoint`, as after `_resume`."""
    config = parse_job_config(yaml.safe_load(job.read_text()), env={})
    trainer = Trainer(config, DistInfo(0, 1, 0, torch.device("cpu")))
    trainer.delivery.buffer = client.stub
    trainer.cursor = ckpt.Cursor.from_json((checkpoint / "cursor.json").read_text())
    trainer.status.saved = (str(checkpoint), trainer.cursor.step)
    return trainer


def test_a_trainer_resumed_after_an_eval_round_goes_on_with_the_next_round(
    buffer,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    client, job = buffer
    checkpoint = tmp_path / "ckpt" / "step-000050"  # written before step 50's eval round
    checkpoint.mkdir(parents=True)
    ckpt.write_cursor(checkpoint, ckpt.Cursor(step=50, policy_version=0, eval_round=0))
    stop = threading.Event()
    rollout = threading.Thread(target=_answer_eval_prompts, args=(client, stop, [1.0] * GROUP_SIZE))
    rollout.start()
    try:
        first = _trainer(job, client, checkpoint)
        first._evaluate()  # round 0: read and acknowledged; then the trainer dies
        resumed = _trainer(job, client, checkpoint)
        started = time.monotonic()
        resumed._evaluate()
        seconds = time.monotonic() - started
    finally:
        stop.set()
        rollout.join(10)
    assert (first.status.metrics["eval/accuracy"], resumed.status.metrics["eval/accuracy"]) == (
        1.0,
        1.0,
    )
    assert (first.cursor.eval_round, resumed.cursor.eval_round) == (1, 2)
    assert seconds < 15  # not the eval timeout (20 s): round 1 was queued and answered
