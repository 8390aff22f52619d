"""A weight publish that failed is retried while the trainer waits for batches.

Found by `kuberl run --chaos`: weight-sync was SIGKILLed while the trainer published versions
55 and 56; the replicas stayed on 54, every group they made was then too stale for
`max_staleness: 1` and was dropped, and the trainer (which published only after a step) waited
for a batch forever. Here the trainer (`kuberl serve trainer`, a real process on a real buffer)
trains step 1 while nothing listens at weight-sync's address; weight-sync then starts there, and
without any further step the trainer's version 1 must reach it.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import yaml

from kuberl.common.redis_server import EmbeddedRedis, PortReservation
from kuberl.local.accounting import read_rows
from kuberl.local.progress import StatsPoller
from tests.integration.buffer_support import Client, start_buffer, write_job
from tests.reliability.test_exactly_once import _group
from tests.support import ServiceProcess


@pytest.mark.slow
def test_a_publish_that_failed_reaches_weight_sync_once_it_is_back(tmp_path: Path) -> None:
    from kuberl.common.modelbuild import build_model

    model = build_model(tmp_path / "model", tokenizer="digits", seed=2)
    record = tmp_path / "trained.jsonl"
    # Weight-sync's port is held (connections refused) until weight-sync serves on it, so no
    # other process can take it during the trainer's first step.
    reserved = PortReservation()
    ws_port = reserved.take()
    with EmbeddedRedis(tmp_path / "redis", die_with_parent=True) as redis_server:
        job = write_job(tmp_path, redis_server.url, prompts=8, job=f"pr{uuid.uuid4().hex[:8]}")
        doc = yaml.safe_load(job.read_text())
        doc["model"] = {"path": str(model)}
        doc["weight_sync"] = {
            "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
            "snapshot_dir": str(tmp_path / "snapshots"),
            "shm_dir": str(tmp_path / "shm"),
        }
        doc["trainer"] = {
            "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
            "mode": "rl",
            "total_steps": 2,
            "groups_per_step": 4,
            "batch_wait_seconds": 1.0,
            "checkpoint_every": 0,  # the job's end still checkpoints: in tmp_path, not the repo
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "linger_seconds": 0.2,
            "max_staleness": -1,
            "optimizer": {"lr": 1e-3},
        }
        with start_buffer(job, tmp_path) as buffer, Client(buffer.address) as client:
            prompts = list(client.lease(8).prompts)
            for i, p in enumerate(prompts[:4]):
                client.put([_group(p, i)], [p.lease_id])
            doc["endpoints"] = {
                "buffer": buffer.address,
                "weight_sync": f"127.0.0.1:{ws_port}",
            }
            rl_job = tmp_path / "rl.yaml"
            rl_job.write_text(yaml.safe_dump(doc))
            trainer = ServiceProcess.kuberl(
                "trainer", rl_job, tmp_path, env={"KUBERL_TRAINED_JSONL": str(record)}
            )
            poller = StatsPoller()
            try:
                deadline = time.monotonic() + 240
                while not any(r["event"] == "step" for r in read_rows(record)):
                    assert trainer.proc.poll() is None, trainer.log()
                    assert time.monotonic() < deadline, trainer.log()
                    time.sleep(0.1)
                ws = ServiceProcess.kuberl(
                    "weight_sync",
                    rl_job,
                    tmp_path,
                    env={"KUBERL_WEIGHT_SYNC__SERVER__PORT": str(ws_port)},
                ).wait_serving(60)
                reserved.release()
                with ws:
                    version = 0
                    deadline = time.monotonic() + 60
                    while version < 1 and time.monotonic() < deadline:
                        status = poller.weight_sync(ws.address)
                        version = status["current_version"] if status else 0
                        time.sleep(0.2)
                    for i, p in enumerate(prompts[4:]):  # step 2 lets the trainer finish
                        client.put([_group(p, 10 + i)], [p.lease_id])
                    code = trainer.proc.wait(120)
            finally:
                reserved.release()
                poller.close()
                trainer.stop()
    assert (version, code) == (1, 0), trainer.log()[-3000:]
