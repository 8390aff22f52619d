"""Helpers for the buffer's integration tests: a job file on a real embedded Redis, buffer
processes started with `kuberl serve buffer`, and groups built like rollout builds them."""

from __future__ import annotations

import json
import math
import uuid
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
    job: str | None = None,
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
        "job": {"name": job or f"t{uuid.uuid4().hex[:10]}", "seed": 7},
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
        resp = self.put([group_for(p, **group_kw) for p in prompts], [p.lease_id for p in prompts])
        return [r.status for r in resp.results]

    def get(
        self,
        n: int,
        *,
        max_staleness: int = -1,
        version: int = 0,
        wait: float = 0.0,
        kind: int = tpb.STREAM_KIND_TRAIN,
        ack: str = "",
        hold: bool = False,
        reopen: bool = False,
    ) -> bpb.GetBatchResponse:
        req = bpb.GetBatchRequest(
            num_groups=n,
            max_staleness=max_staleness,
            current_version=version,
            consumer="trainer",
            wait_seconds=wait,
            kind=kind,
            ack_batch_id=ack,
            hold=hold,
            reopen_held=reopen,
        )
        return self.stub.GetBatch(req, timeout=30 + wait)

    def ack(self, batch_id: str, hold: bool = False) -> bpb.AckResponse:
        return self.stub.Ack(bpb.AckRequest(batch_id=batch_id, hold=hold), timeout=30)

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


def corrupt_put(kind: str) -> tuple[list[tpb.Group], list[str]]:
    """A put request (groups, lease ids) with one defect, for prompt train:0 of a job whose
    epoch 0 is queued; REJECTIONS[kind] is part of the error message it must get."""
    g = make_group("train:0")
    t = g.trajectories[1]
    if kind == "group_size":
        return [make_group("train:0", size=GROUP_SIZE - 1)], []
    if kind == "logprobs_length":
        t.rollout_logprobs.data = t.rollout_logprobs.data[:-4]
    elif kind == "mask_length":
        t.loss_mask.data = t.loss_mask.data + b"\x01"
    elif kind == "nan_reward":
        t.reward = math.nan
    elif kind == "inf_logprob":
        t.rollout_logprobs.data = np.full(8, -np.inf, np.float32).tobytes()
    elif kind == "nan_breakdown":
        t.reward_breakdown["gsm8k"] = math.nan
    elif kind == "bad_dtype":
        t.response_token_ids.dtype = "int128"
    elif kind == "ragged_bytes":
        t.response_token_ids.data = t.response_token_ids.data[:-1]
    elif kind == "other_prompt":
        t.prompt_id = "train:1"
    elif kind == "repeated_sample_index":
        t.sample_index = 0
    elif kind == "unknown_prompt":
        return [make_group("nope:0")], ["0-1"]
    elif kind == "epoch_never_queued":
        return [make_group("train:0", epoch=5)], ["0-1"]
    elif kind == "lease_count":
        return [make_group("train:0"), make_group("train:1")], ["1-0"]
    elif kind == "no_groups":
        return [], []
    return [g], []


REJECTIONS = {
    "group_size": "the job's group size is 4",
    "logprobs_length": "rollout_logprobs has 7 entries",
    "mask_length": "loss_mask has 9 entries",
    "nan_reward": "reward is nan",
    "inf_logprob": "rollout_logprobs[0] is -inf",
    "nan_breakdown": "reward_breakdown['gsm8k'] is nan",
    "bad_dtype": "unsupported dtype 'int128'",
    "ragged_bytes": "not a whole number of int32",
    "other_prompt": "belongs to prompt 'train:1'",
    "repeated_sample_index": "sample_index values repeat",
    "unknown_prompt": "'nope:0' is not a prompt of job",
    "epoch_never_queued": "epoch 5 of prompt 'train:0' was never handed out",
    "lease_count": "1 lease_ids for 2 groups",
    "no_groups": "no groups to put",
}


def group_for(prompt: tpb.Prompt, **kw: Any) -> tpb.Group:
    return make_group(prompt.prompt_id, prompt.epoch, **kw)


def prompt_keys(batch: bpb.GetBatchResponse) -> list[tuple[str, int]]:
    return [(g.prompt_id, g.epoch) for g in batch.groups]


def _main(argv: list[str]) -> None:
    """Stand-ins for a rollout replica or a trainer that get killed mid-work by the tests:
    `lease ADDRESS N CONSUMER` leases and `get ADDRESS N` takes a batch, print the result as one
    JSON line, then wait (never completing or acknowledging) until killed."""
    import sys
    import time

    command, address, n = argv[0], argv[1], int(argv[2])
    with Client(address) as client:
        if command == "lease":
            resp = client.lease(n, consumer=argv[3])
            out = {"prompts": [p.prompt_id for p in resp.prompts]}
        else:
            batch = client.get(n)
            out = {"batch_id": batch.batch_id, "prompts": [g.prompt_id for g in batch.groups]}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
        time.sleep(3600)


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
