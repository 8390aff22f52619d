"""The trainer's batch bookkeeping (`kuberl.trainer.delivery`) against `kuberl serve buffer` on a
real embedded Redis: acknowledgement with the next GetBatch, holds until a checkpoint, held
batches handed back to a restarted trainer with their ids, re-delivered batches the checkpoint
has settled untrained, groups trained before left out of a new batch. The test plays rollout."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import yaml

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.common.config import parse_job_config
from kuberl.common.redis_server import EmbeddedRedis
from kuberl.trainer import checkpoint as ckpt
from kuberl.trainer.batch import Batch, Rejection
from kuberl.trainer.control import MSG_BATCH, MSG_EXHAUSTED, MSG_STOP
from kuberl.trainer.delivery import BatchDelivery, receive
from kuberl.trainer.distributed import DistInfo
from kuberl.trainer.loop import Trainer
from tests.integration.buffer_support import Client, start_buffer, write_job

VOCAB = 1000  # make_group's token ids are below it
PROMPTS = 6


@pytest.fixture
def buffer(tmp_path: Path) -> Iterator[tuple[Client, Callable[[], BatchDelivery]]]:
    """A buffer of PROMPTS prompts, one epoch, and a factory of rank-0 deliveries of a trainer
    that takes 2 groups a step and checkpoints every 2 steps (a new one = a restarted trainer)."""
    with EmbeddedRedis(tmp_path / "redis", die_with_parent=True) as redis:
        job = write_job(tmp_path, redis.url, prompts=PROMPTS)
        doc = yaml.safe_load(job.read_text())
        doc["trainer"] = {
            "groups_per_step": 2,
            "checkpoint_every": 2,
            "batch_wait_seconds": 1.0,
            "max_staleness": -1,
        }
        job.write_text(yaml.safe_dump(doc))
        config = parse_job_config(doc, env={})
        with start_buffer(job, tmp_path) as svc, Client(svc.address) as client:

            def delivery() -> BatchDelivery:
                return BatchDelivery(config.trainer, client.stub, is_main=True)

            yield client, delivery


def _roll_out(client: Client, n: int) -> list[str]:
    """Rollout: lease n prompts and put one group for each; their `<prompt>@<epoch>` keys."""
    prompts = list(client.lease(n).prompts)
    assert client.complete(prompts) == [bpb.PUT_STATUS_ACCEPTED] * n
    return [f"{p.prompt_id}@{p.epoch}" for p in prompts]


def _next(delivery: BatchDelivery, cursor: ckpt.Cursor | None = None) -> Batch:
    tag = delivery.fetch(sft=False, policy_version=0, interrupt=lambda: None)
    assert tag[:1] == MSG_BATCH, tag[:1]
    return receive(tag[1:], sft=False, cursor=cursor or ckpt.Cursor(), vocab_size=VOCAB)


def _held_and_unacked(client: Client) -> tuple[int, int]:
    stats = client.stats()
    return stats.batches_held, stats.batches_unacked


def test_a_trained_batch_is_acknowledged_by_the_next_get_batch(buffer) -> None:  # type: ignore[no-untyped-def]
    client, deliveries = buffer
    delivery = deliveries()
    _roll_out(client, 4)
    first = _next(delivery)
    delivery.trained(first.batch_id, unsaved=False)  # a checkpoint has its step
    _next(delivery)
    assert _held_and_unacked(client) == (0, 1)  # only the second batch is out


def test_a_batch_no_checkpoint_has_is_held_and_acknowledged_after_the_next_checkpoint(
    buffer,  # type: ignore[no-untyped-def]
) -> None:
    client, deliveries = buffer
    delivery = deliveries()
    _roll_out(client, 4)
    first = _next(delivery)
    delivery.trained(first.batch_id, unsaved=True)
    second = _next(delivery)  # holds the first
    held = _held_and_unacked(client)
    delivery.trained(second.batch_id, unsaved=True)
    delivery.commit_held()  # the checkpoint of both steps is written
    delivery.flush()  # the job ends: the second goes as a plain Ack
    assert (held, _held_and_unacked(client), delivery.uncommitted) == ((1, 1), (0, 0), [])


def test_a_restarted_trainer_gets_its_held_batches_back_with_their_ids(buffer) -> None:  # type: ignore[no-untyped-def]
    client, deliveries = buffer
    before = deliveries()
    _roll_out(client, 4)
    first = _next(before)
    before.trained(first.batch_id, unsaved=True)
    _next(before)  # holds the first; then the trainer dies before its checkpoint
    after = deliveries()
    started = time.monotonic()
    again = _next(after)
    seconds = time.monotonic() - started
    assert (again.batch_id, again.group_keys) == (first.batch_id, first.group_keys)
    assert seconds < 10  # handed back at once, not after the batch ack timeout (30 s)


def test_a_redelivered_batch_the_checkpoint_has_is_only_acknowledged(buffer) -> None:  # type: ignore[no-untyped-def]
    client, deliveries = buffer
    before = deliveries()
    _roll_out(client, 2)
    first = _next(before)
    before.trained(first.batch_id, unsaved=True)
    before.flush()  # held; the checkpoint is written, then the trainer dies before its Ack
    cursor = ckpt.Cursor()
    cursor.note_trained(first.batch_id, first.group_keys)
    after = deliveries()
    again = _next(after, cursor)
    after.settle_trained(again.batch_id)
    assert (again.batch_id, _held_and_unacked(client)) == (first.batch_id, (0, 0))


def test_groups_trained_before_are_left_out_of_a_batch_with_another_id(buffer) -> None:  # type: ignore[no-untyped-def]
    client, deliveries = buffer
    delivery = deliveries()
    keys = _roll_out(client, 2)
    cursor = ckpt.Cursor()
    cursor.note_trained("train-lost", keys[:1])  # its batch's record lost with Redis
    batch = _next(delivery, cursor)
    assert (batch.group_keys, batch.rejected) == (
        keys[1:],
        [Rejection(keys[0], "already_trained")],
    )


def test_an_acknowledgement_the_buffer_does_not_know_does_not_stop_the_next_batch(
    buffer,  # type: ignore[no-untyped-def]
) -> None:
    client, deliveries = buffer
    delivery = deliveries()
    _roll_out(client, 2)
    delivery.unacked = "train-999"  # its Redis lost the batch
    batch = _next(delivery)
    assert (len(batch.groups), delivery.ack("train-998")) == (2, True)


def test_the_wait_for_a_batch_ends_on_a_stop_and_when_the_data_is_exhausted(buffer) -> None:  # type: ignore[no-untyped-def]
    client, deliveries = buffer
    delivery = deliveries()
    stopped = delivery.fetch(sft=False, policy_version=0, interrupt=lambda: MSG_STOP)
    _roll_out(client, PROMPTS)
    for _ in range(PROMPTS // 2):
        delivery.trained(_next(delivery).batch_id, unsaved=False)
    last = delivery.fetch(sft=False, policy_version=0, interrupt=lambda: None)
    assert (stopped, last) == (MSG_STOP, MSG_EXHAUSTED)


def test_a_trainer_settles_a_batch_with_no_usable_group_held_while_steps_are_unsaved(
    buffer,  # type: ignore[no-untyped-def]
) -> None:
    client, deliveries = buffer
    delivery = deliveries()
    keys = _roll_out(client, 2)
    cursor = ckpt.Cursor()
    cursor.note_trained("train-lost", keys)
    batch = _next(delivery, cursor)
    delivery.skipped(batch.batch_id, unsaved=True)
    assert (batch.samples, _held_and_unacked(client), delivery.uncommitted) == (
        [],
        (1, 0),
        [batch.batch_id],
    )


def test_a_resumed_warm_up_acknowledges_the_sft_batches_its_checkpoint_names(
    buffer,  # type: ignore[no-untyped-def]
) -> None:
    client, deliveries = buffer
    delivery = deliveries()
    _roll_out(client, 2)
    first = _next(delivery)
    trainer = Trainer(
        parse_job_config({"trainer": {"sft_steps": 1}}, env={}),
        DistInfo(0, 1, 0, torch.device("cpu")),
    )
    trainer.delivery = delivery
    trainer.cursor.sft_step = 1
    trainer.cursor.note_trained("sft-0")
    trainer.cursor.note_trained(first.batch_id)  # an RL batch: left to the RL stream
    trainer._acknowledge_warm_up()
    assert _held_and_unacked(client) == (0, 1)
