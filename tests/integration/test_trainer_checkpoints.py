"""What the trainer saves where a job ends and when asked, and the epoch it reports:
`kuberl serve trainer` processes, in rl mode against `kuberl serve buffer` on an embedded Redis
(the test plays rollout), in sft mode on a file.

- With `checkpoint_every: 0` (no periodic checkpoints) the job's end still writes one final
  checkpoint with its HF export, in rl and sft mode, and leaves no batch unacknowledged.
- GetStatus.epoch in rl mode is the newest dataset epoch of the groups trained (the buffer's
  `<prompt>@<epoch>`), not that of the SFT warm-up's file, and kept across a resume by the
  checkpoint's cursor.
- A CheckpointNow when the newest checkpoint holds the current step already (it came while or
  just after that step's save) is answered with that checkpoint: no second save of the same
  weights.

The rl jobs share one buffer and checkpoint folder: the first trainer warms up on a file (five
steps, into the file's third epoch), trains two RL steps (epoch 0, then epoch 1) and exits; the
second resumes from its final checkpoint and waits for rollout.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from kuberl.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from kuberl.common.channels import sync_channel
from tests.integration.buffer_support import Client, start_buffer, write_job
from tests.integration.test_trainer_rl import _group
from tests.integration.test_trainer_sft_resume import _write_job
from tests.support import ServiceProcess


def _folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step-*"))


def _serve_until_exit(trainer: ServiceProcess, timeout: float) -> trainer_pb2.GetStatusResponse:
    """GetStatus until the trainer exits: the last answer (finished, while it lingers)."""
    trainer.wait_serving(120)
    last = trainer_pb2.GetStatusResponse()
    deadline = time.monotonic() + timeout
    with sync_channel(trainer.address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        while trainer.proc.poll() is None and time.monotonic() < deadline:
            # The server drains after lingering: the last answer stands.
            with contextlib.suppress(grpc.RpcError):
                last = stub.GetStatus(trainer_pb2.GetStatusRequest(), timeout=5)
            time.sleep(0.1)
    assert trainer.proc.wait(30) == 0, trainer.log()[-3000:]
    return last


@pytest.fixture(scope="module")
def rl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from kuberl.common.modelbuild import build_model
    from kuberl.common.redis_server import EmbeddedRedis

    tmp = tmp_path_factory.mktemp("rl-ckpt")
    model = build_model(tmp / "model", tokenizer="digits", seed=2)
    with EmbeddedRedis(tmp / "redis", die_with_parent=True) as redis:
        # Three epochs of two prompts: epochs 0 and 1 are trained, epoch 2 stays queued, so the
        # buffer is not exhausted and the resumed trainer waits for rollout.
        job = write_job(tmp, redis.url, prompts=2, epochs=3, job=f"ck{uuid.uuid4().hex[:8]}")
        doc = yaml.safe_load(job.read_text())
        with start_buffer(job, tmp) as buffer, Client(buffer.address) as client:
            leased = []
            for _ in range(2):  # epoch 0, then epoch 1
                prompts = sorted(client.lease(2).prompts, key=lambda p: p.prompt_id)
                for i, p in enumerate(prompts):  # one put each: oldest first
                    client.put([_group(p, [1.0, 0.0, 0.0, 1.0], len(leased) + i)], [p.lease_id])
                leased += [(p.prompt_id, p.epoch) for p in prompts]
            pairs = tmp / "pairs.jsonl"  # 8 pairs, 4 a step: 2 warm-up steps an epoch
            pairs.write_text(
                "".join(f'{{"prompt": "{i}+1=", "response": "{i + 1}"}}\n' for i in range(8))
            )
            doc["endpoints"] = {"buffer": buffer.address}
            doc["model"] = {"path": str(model)}
            doc["trainer"] = {
                "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
                "mode": "rl",
                "total_steps": 2,
                "sft_steps": 5,
                "sft_data": str(pairs),
                "sft_batch_size": 4,
                "groups_per_step": 2,
                "micro_batch_tokens": 64,
                "batch_wait_seconds": 1.0,
                "max_staleness": -1,
                "publish_weights": False,
                "checkpoint_every": 0,
                "checkpoint_dir": str(tmp / "ckpt"),
                "linger_seconds": 2.0,
            }
            first_job = tmp / "first.yaml"
            first_job.write_text(yaml.safe_dump(doc))
            with ServiceProcess.kuberl("trainer", first_job, tmp, name="first") as first:
                first_status = _serve_until_exit(first, 180)
            stats = client.stats()
            after_first = _folders(tmp / "ckpt")
            # The same job resumed with a step to go: it waits for a batch that never comes.
            doc["trainer"]["total_steps"] = 3
            second_job = tmp / "second.yaml"
            second_job.write_text(yaml.safe_dump(doc))
            with ServiceProcess.kuberl("trainer", second_job, tmp, name="second") as second:
                second.wait_serving(120)
                with sync_channel(second.address) as channel:
                    stub = trainer_pb2_grpc.TrainerServiceStub(channel)
                    second_status = stub.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
                    saved = stub.CheckpointNow(trainer_pb2.CheckpointNowRequest(), timeout=120)
                after_second = _folders(tmp / "ckpt")
    return {
        "tmp": tmp,
        "leased": leased,
        "first_status": first_status,
        "stats": stats,
        "after_first": after_first,
        "second_status": second_status,
        "checkpoint_now": (Path(saved.path).name, saved.step),
        "after_second": after_second,
    }


def test_an_rl_job_without_periodic_checkpoints_ends_with_one_final_checkpoint(rl) -> None:  # type: ignore[no-untyped-def]
    final = rl["tmp"] / "ckpt" / "step-000002"
    assert rl["leased"] == [("train:0", 0), ("train:1", 0), ("train:0", 1), ("train:1", 1)]
    assert (
        rl["first_status"].finished,
        rl["after_first"],
        (final / "hf" / "model.safetensors").is_file(),
        rl["stats"].batches_unacked,
        rl["stats"].batches_held,
    ) == (True, ["step-000002"], True, 0, 0)


def test_rl_status_epoch_is_the_newest_dataset_epoch_trained_and_kept_across_a_resume(rl) -> None:  # type: ignore[no-untyped-def]
    cursor = json.loads((rl["tmp"] / "ckpt" / "step-000002" / "cursor.json").read_text())
    assert (rl["first_status"].epoch, cursor["epoch"], rl["second_status"].epoch) == (1, 1, 1)


def test_checkpoint_now_at_a_step_already_saved_answers_with_that_checkpoint(rl) -> None:  # type: ignore[no-untyped-def]
    # The resumed trainer's weights are its checkpoint's: the request is answered with it, and
    # no step-000002.1 holds the same weights again.
    assert (rl["second_status"].step, rl["checkpoint_now"], rl["after_second"]) == (
        2,
        ("step-000002", 2),
        ["step-000002"],
    )


def test_an_sft_job_without_periodic_checkpoints_ends_with_one_final_checkpoint(
    tmp_path: Path,
) -> None:
    from kuberl.common.modelbuild import build_model

    model = build_model(tmp_path / "model", tokenizer="digits", seed=5)
    job = _write_job(tmp_path, model)  # 64 pairs, 16 a step: 4 steps an epoch
    doc = yaml.safe_load(job.read_text())
    doc["trainer"].update(total_steps=5, checkpoint_every=0, gradient_checkpointing=False)
    job.write_text(yaml.safe_dump(doc))
    with ServiceProcess.kuberl("trainer", job, tmp_path) as trainer:
        code = trainer.proc.wait(180)
        log = trainer.log()
    final = tmp_path / "ckpt" / "step-000005"
    cursor = json.loads((final / "cursor.json").read_text()) if final.exists() else {}
    assert (
        code,
        _folders(tmp_path / "ckpt"),
        (final / "hf" / "model.safetensors").is_file(),
        cursor.get("epoch"),  # sft mode's epoch: step 5 reads the file's second epoch
    ) == (0, ["step-000005"], True, 1), log[-3000:]
