"""Helpers for the buffer's integration tests: a job file on a real embedded Redis, buffer
processes started with `kuberl serve buffer`, and groups built like rollout builds them."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.api.buffer.v1 import buffer_pb2_grpc
from kuberl.api.common.v1 import trajectory_pb2 as tpb
from kuberl.common.channels import sync_channel
from kuberl.common.trajectory import Group, Trajectory
from tests.support import ServiceProcess

GROUP_SIZE = 4


def write_prompts(path: Path, n: int) -> Path:
    """A JSONL dataset of n arithmetic prompts with a `question`/`answer`/`level` schema."""
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"question": f"{i} + {i} = ?", "answer": 2 * i, "level": i % 3}))
            f.write("\n")
    return path


def write_job(
    tmp_path: Path,
    redis_url: str,
    *,
    prompts: int = 16,
    eval_prompts: int = 0,
    epochs: int = 1,
    name: str = "job.yaml",
    **buffer: Any,
) -> Path:
    """A job file whose buffer uses redis_url, free ports and short timeouts."""
    train = write_prompts(tmp_path / "train.jsonl", prompts)
    data: dict[str, Any] = {
        "train": [{"path": str(train), "columns": {"prompt": "question", "answer": "answer"}}],
        "num_epochs": epochs,
    }
    if eval_prompts:
        evals = write_prompts(tmp_path / "eval.jsonl", eval_prompts)
        data["eval"] = [{"path": str(evals), "columns": {"prompt": "question"}}]
    job = {
        "job": {"name": "t", "seed": 7},
        "redis": {"url": redis_url, "connect_timeout_seconds": 20},
        "data": data,
        "rollout": {"group_size": GROUP_SIZE},
        "buffer": {
            "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
            "lease_timeout_seconds": 30,
            "batch_ack_timeout_seconds": 30,
            "max_inflight_groups": 1000,
            **buffer,
        },
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(job))
    return path


def start_buffer(config: Path, workdir: Path, name: str = "buffer") -> ServiceProcess:
    return ServiceProcess.kuberl("buffer", config, workdir, name=name).wait_serving(60)


class Client:
    """A synchronous BufferService client with short helpers for tests."""

    def __init__(self, address: str) -> None:
        self.channel = sync_channel(address)
        self.stub = buffer_pb2_grpc.BufferServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def lease(
        self, n: int, consumer: str = "r0", kind: int = tpb.STREAM_KIND_TRAIN
    ) -> bpb.LeasePromptsResponse:
        req = bpb.LeasePromptsRequest(max_prompts=n, consumer=consumer, kind=kind)
        return self.stub.LeasePrompts(req, timeout=30)

    def put(
        self,
        groups: Iterable[tpb.Group],
        lease_ids: Iterable[str] = (),
        kind: int = tpb.STREAM_KIND_TRAIN,
    ) -> bpb.PutTrajectoriesResponse:
        req = bpb.PutTrajectoriesRequest(
            groups=list(groups), lease_ids=list(lease_ids), consumer="r0", kind=kind
        )
        return self.stub.PutTrajectories(req, timeout=30)

    def complete(self, prompts: Iterable[tpb.Prompt], **group_kw: Any) -> list[int]:
        """Put one group per leased prompt; the put statuses."""
        prompts = list(prompts)
        resp = self.put(
            [group_for(p, **group_kw) for p in prompts], [p.lease_id for p in prompts]
        )
        return [r.status for r in resp.results]

    def get(
        self,
        n: int,
        *,
        max_staleness: int = -1,
        version: int = 0,
        wait: float = 0.0,
        kind: int = tpb.STREAM_KIND_TRAIN,
    ) -> bpb.GetBatchResponse:
        req = bpb.GetBatchRequest(
            num_groups=n,
            max_staleness=max_staleness,
            current_version=version,
            consumer="trainer",
            wait_seconds=wait,
            kind=kind,
        )
        return self.stub.GetBatch(req, timeout=30 + wait)

    def ack(self, batch_id: str) -> bpb.AckResponse:
        return self.stub.Ack(bpb.AckRequest(batch_id=batch_id), timeout=30)

    def stats(self) -> bpb.GetStatsResponse:
        return self.stub.GetStats(bpb.GetStatsRequest(), timeout=30)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_group(
    prompt_id: str,
    epoch: int = 0,
    *,
    size: int = GROUP_SIZE,
    rewards: list[float] | None = None,
    version: int = 0,
    length: int = 8,
) -> tpb.Group:
    """A group of `size` trajectories with distinct sample indices and valid arrays."""
    rewards = rewards if rewards is not None else [float(i % 2) for i in range(size)]
    rng = np.random.default_rng(abs(hash((prompt_id, epoch))) % 2**32)
    trajectories = [
        Trajectory(
            prompt_token_ids=rng.integers(0, 1000, 5),
            response_token_ids=rng.integers(0, 1000, length),
            rollout_logprobs=-rng.random(length).astype(np.float32),
            prompt_id=prompt_id,
            epoch=epoch,
            sample_index=i,
            reward=rewards[i],
            policy_version_start=version,
            policy_version_end=version,
        )
        for i in range(size)
    ]
    return Group(prompt_id=prompt_id, epoch=epoch, trajectories=trajectories).to_proto()


def group_for(prompt: tpb.Prompt, **kw: Any) -> tpb.Group:
    return make_group(prompt.prompt_id, prompt.epoch, **kw)


def prompt_keys(batch: bpb.GetBatchResponse) -> list[tuple[str, int]]:
    return [(g.prompt_id, g.epoch) for g in batch.groups]
