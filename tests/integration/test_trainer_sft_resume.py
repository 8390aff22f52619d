"""The trainer as it runs in production (`kuberl serve trainer`, a real process): SFT on a tiny
arithmetic task drives the loss down; a trainer SIGKILLed mid-job and started again resumes from
its last checkpoint and computes exactly the next-step loss the killed one computed; GetStatus
and CheckpointNow answer while it trains; each checkpoint holds an HF safetensors export that
transformers loads.

Both cases share two trainer processes (DeepSpeed start-up is the slow part): the first is
killed, the second resumes and runs to `total_steps` and exits 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import yaml

from kuberl.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from kuberl.common.channels import sync_channel
from kuberl.local.accounting import read_rows
from tests.support import ServiceProcess

TOTAL_STEPS = 10


def _write_job(tmp: Path, model: Path) -> Path:
    rng = random.Random(0)
    with (tmp / "pairs.jsonl").open("w") as f:
        for _ in range(64):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "response": str(a + b)}) + "\n")
    job = {
        "job": {"name": "sft-resume", "seed": 1},
        "model": {"path": str(model)},
        "trainer": {
            "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
            "mode": "sft",
            "total_steps": TOTAL_STEPS,
            "sft_data": str(tmp / "pairs.jsonl"),
            "sft_batch_size": 16,
            "micro_batch_tokens": 96,
            "gradient_checkpointing": True,
            "publish_weights": False,
            "checkpoint_every": 2,
            "checkpoint_dir": str(tmp / "ckpt"),
            "linger_seconds": 0.2,
            "optimizer": {"lr": 3e-3},
        },
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _freeze(pid: int) -> None:
    """SIGSTOP `pid` and wait until every thread of it has stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        if all(state in "TtZ" for state in states):
            return
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} did not stop")


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss/sft"] for r in read_rows(path) if r.get("kind") == "sft"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from kuberl.common.modelbuild import build_model

    tmp = tmp_path_factory.mktemp("sft")
    model = build_model(tmp / "model", tokenizer="digits", seed=5)
    job = _write_job(tmp, model)
    first_jsonl, second_jsonl = tmp / "first.jsonl", tmp / "second.jsonl"

    first = ServiceProcess.kuberl(
        "trainer", job, tmp, name="first", env={"KUBERL_METRICS_JSONL": str(first_jsonl)}
    )
    observed: dict[str, object] = {}
    try:
        first.wait_serving(120)
        with sync_channel(first.address) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            saved = stub.CheckpointNow(trainer_pb2.CheckpointNowRequest(), timeout=120)
            observed["checkpoint_now"] = (saved.path, saved.step)
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline and max(_losses(first_jsonl), default=0) < 3:
                time.sleep(0.05)
            observed["status"] = stub.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
        # Kill once a checkpoint exists and the step after it has been recorded. Both are read
        # while the trainer is stopped (SIGSTOP), so no newer checkpoint can slip in between
        # the check and the kill (one did once: killed after checkpoint 6, before step 7).
        while time.monotonic() < deadline:
            _freeze(first.proc.pid)
            latest = tmp / "ckpt" / "latest"
            if latest.exists():
                cursor = tmp / "ckpt" / latest.read_text().strip() / "cursor.json"
                step = json.loads(cursor.read_text())["step"]
                if step >= 2 and step + 1 in _losses(first_jsonl):
                    break
            first.signal(signal.SIGCONT)
            time.sleep(0.05)
        first.signal(signal.SIGKILL)
        first.proc.wait(30)
    finally:
        first.stop()
    resumed_from = (tmp / "ckpt" / "latest").read_text().strip()

    second = ServiceProcess.kuberl(
        "trainer", job, tmp, name="second", env={"KUBERL_METRICS_JSONL": str(second_jsonl)}
    )
    try:
        code = second.proc.wait(240)
        second_log = second.log()
    finally:
        second.stop()
    return {
        "tmp": tmp,
        "first": _losses(first_jsonl),
        "second": _losses(second_jsonl),
        "resumed_from": resumed_from,
        "second_code": code,
        "second_log": second_log,
        **observed,
    }


def test_a_sigkilled_trainer_resumes_with_the_same_next_step_loss(runs) -> None:  # type: ignore[no-untyped-def]
    resumed_step = int(runs["resumed_from"].removeprefix("step-"))
    first, second = runs["first"], runs["second"]
    assert min(second) == resumed_step + 1, runs["second_log"]
    assert second[resumed_step + 1] == pytest.approx(first[resumed_step + 1], rel=1e-6, abs=0)


def test_sft_drives_the_loss_down_and_the_job_exits_0_at_total_steps(runs) -> None:  # type: ignore[no-untyped-def]
    losses = {**runs["first"], **runs["second"]}
    assert runs["second_code"] == 0, runs["second_log"]
    assert max(losses) == TOTAL_STEPS
    assert losses[TOTAL_STEPS] < 0.6 * losses[1]


def test_status_and_checkpoint_now_answer_while_training(runs) -> None:  # type: ignore[no-untyped-def]
    status = runs["status"]
    path, step = runs["checkpoint_now"]
    assert (status.mode, status.total_steps, status.world_size) == ("sft", TOTAL_STEPS, 1)
    assert status.step >= 3 and "loss/sft" in status.metrics and not status.finished
    # step-NNNNNN, also when the periodic checkpoint had just saved that step: it is the
    # answer then, not a second save (step-NNNNNN.1)
    assert (Path(path).parent, Path(path).name) == (runs["tmp"] / "ckpt", f"step-{step:06d}")


def test_each_checkpoint_holds_an_hf_export_that_transformers_loads(runs) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM

    ckpt = runs["tmp"] / "ckpt" / f"step-{TOTAL_STEPS:06d}"
    model = AutoModelForCausalLM.from_pretrained(ckpt / "hf", local_files_only=True)
    ids = torch.tensor([[10, 11, 12]])
    logits = model(input_ids=ids).logits
    assert logits.shape[:2] == (1, 3) and torch.isfinite(logits).all()
    base = AutoModelForCausalLM.from_pretrained(runs["tmp"] / "model", local_files_only=True)
    moved = (model.model.embed_tokens.weight - base.model.embed_tokens.weight).abs().max()
    assert moved > 1e-4  # the export holds trained weights, not the initial ones
