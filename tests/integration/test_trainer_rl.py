"""The RL loop against the real services: `kuberl serve buffer` on an embedded Redis,
`kuberl serve weight_sync`, and `kuberl serve trainer`, each its own process.

The trainer runs as two torchrun ranks with ZeRO-3 on gloo (rank 0 serves and talks to the
services; both train). The test plays rollout: it leases six prompts, puts five groups of four
samples (token ids of the tiny model's vocabulary, engine logprobs, rewards), the oldest of them
with token ids outside the vocabulary, and one group of two kept samples on the SFT stream (as
rejection sampling does). The trainer takes one SFT warm-start step on that stream, evaluates (the
test answers the eval prompts it queues, as rollout would), then takes three RL steps (GRPO, PPO
with two epochs over two mini-batches, old logprobs recomputed, KL to a frozen reference offloaded
to CPU memory (DeepSpeed's offload_param), TIS), leaving out and counting the unusable group,
acknowledges each batch after its optimizer step, advances the buffer's policy version, publishes
every other version to weight-sync (and the current one before each eval round and at the end),
checkpoints at the end and exits 0 after a second evaluation. The weights weight-sync holds for the
last version are exactly the trainer's exported weights.
"""

from __future__ import annotations

import json
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from kuberl.api.common.v1 import trajectory_pb2 as tpb
from kuberl.common.trajectory import Group, Trajectory
from tests.integration.buffer_support import Client, start_buffer, write_job
from tests.support import ServiceProcess

GROUP_SIZE = 4
# Two ranks on gloo, as `torchrun --nproc-per-node 2 -m kuberl.cli serve trainer` in a pod.
TORCHRUN = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--nproc-per-node",
    "2",
    "--rdzv-backend",
    "c10d",
    "--rdzv-endpoint",
    "127.0.0.1:0",
]
EVAL_REWARDS = [1.0, 0.0, 0.0, 0.0]
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]


def _group(prompt: tpb.Prompt, rewards: list[float], seed: int, vocab: int = 90) -> tpb.Group:
    rng = np.random.default_rng(seed)
    trajectories = []
    for i, reward in enumerate(rewards):
        n = int(rng.integers(3, 9))
        trajectories.append(
            Trajectory(
                prompt_token_ids=rng.integers(10, 90, 4),
                response_token_ids=rng.integers(10, vocab, n),
                rollout_logprobs=np.log(rng.uniform(0.005, 0.02, n)).astype(np.float32),
                prompt_id=prompt.prompt_id,
                epoch=prompt.epoch,
                sample_index=i,
                reward=reward,
            )
        )
    return Group(prompt.prompt_id, prompt.epoch, trajectories).to_proto()


def _play_eval_rollout(client: Client, trainer: ServiceProcess, timeout: float = 240) -> list[int]:
    """Answer every eval prompt the trainer queues (StartEval) with a group in which one
    sample of four is correct, until the trainer exits; the eval rounds seen."""
    rounds: list[int] = []
    deadline = time.monotonic() + timeout
    while trainer.proc.poll() is None and time.monotonic() < deadline:
        leased = list(client.lease(8, consumer="eval-r0", kind=tpb.STREAM_KIND_EVAL).prompts)
        if not leased:
            time.sleep(0.2)
            continue
        groups = [_group(p, EVAL_REWARDS, 100 + i) for i, p in enumerate(leased)]
        client.put(groups, [p.lease_id for p in leased], kind=tpb.STREAM_KIND_EVAL)
        rounds += sorted({p.epoch for p in leased} - set(rounds))
    return rounds


def _until_exit(
    client: Client, trainer: ServiceProcess, timeout: float
) -> tuple[list[int], int, str]:
    """Play eval rollout until the trainer exits: the eval rounds, its exit code and its log."""
    try:
        rounds = _play_eval_rollout(client, trainer)
        code = trainer.proc.wait(timeout)
        return rounds, code, trainer.log_path.read_text(errors="replace")
    finally:
        trainer.stop()


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from kuberl.common.modelbuild import build_model
    from kuberl.common.redis_server import EmbeddedRedis
    from kuberl.common.weights import download_snapshot

    tmp = tmp_path_factory.mktemp("rl")
    model = build_model(tmp / "model", tokenizer="digits", seed=2)
    with EmbeddedRedis(tmp / "redis", die_with_parent=True) as redis:
        job = write_job(tmp, redis.url, prompts=6, eval_prompts=2, job=f"rl{uuid.uuid4().hex[:8]}")
        doc = yaml.safe_load(job.read_text())
        doc["weight_sync"] = {
            "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
            "snapshot_dir": str(tmp / "snapshots"),
            "shm_dir": str(tmp / "shm"),
        }
        doc["trainer"] = {"mode": "rl", "sft_steps": 1}  # the buffer takes SFT groups it reads
        job.write_text(yaml.safe_dump(doc))
        with (
            start_buffer(job, tmp) as buffer,
            ServiceProcess.kuberl("weight_sync", job, tmp).wait_serving(60) as ws,
            Client(buffer.address) as client,
        ):
            prompts = list(client.lease(6).prompts)
            prompts.sort(key=lambda p: int(p.prompt_id.rsplit(":", 1)[1]))
            sft_prompt = prompts.pop()  # rejection sampling kept 2 of its 4 samples
            kept = _group(sft_prompt, [1.0, 1.0], 7)
            client.put([kept], [sft_prompt.lease_id], kind=tpb.STREAM_KIND_SFT)
            groups = [_group(prompts[0], REWARDS[0], 9, vocab=5000)]  # not this model's ids
            groups += [_group(p, REWARDS[i], i) for i, p in enumerate(prompts[1:])]
            for p, g in zip(prompts, groups, strict=True):  # one put each: oldest first
                client.put([g], [p.lease_id])
            doc["endpoints"] = {"buffer": buffer.address, "weight_sync": ws.address}
            doc["model"] = {"path": str(model)}
            doc["trainer"] = {
                "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
                "mode": "rl",
                "total_steps": 3,
                "sft_steps": 1,
                "batch_wait_seconds": 1.0,
                "zero_stage": 3,
                "groups_per_step": 2,
                "micro_batch_tokens": 40,
                "checkpoint_every": 2,
                "publish_every": 3,
                "eval_every": 2,
                "checkpoint_dir": str(tmp / "ckpt"),
                "linger_seconds": 0.2,
                "max_staleness": -1,
                "optimizer": {"lr": 1e-3},
                "algorithm": {
                    "advantage": "grpo",
                    "ppo_epochs": 2,
                    "mini_batches": 2,
                    "recompute_old_logprobs": True,
                    "kl": {"coef": 0.01, "offload_reference": True},
                    "importance": {"mode": "tis", "cap": 2.0},
                },
            }
            rl_job = tmp / "rl.yaml"
            rl_job.write_text(yaml.safe_dump(doc))
            jsonl = tmp / "metrics.jsonl"
            trainer = ServiceProcess(
                [*TORCHRUN, "-m", "kuberl.cli", "serve", "trainer", "--config", str(rl_job)],
                tmp,
                "trainer",
                env={"KUBERL_METRICS_JSONL": str(jsonl)},
            )
            eval_rounds, code, log = _until_exit(client, trainer, 240)
            stats = client.stats()
            version, manifest, flat = download_snapshot(ws.address)
            published = {k: v.clone() for k, v in manifest.views(flat).items()}
            # Then `mode: eval` from the same checkpoint folder: one eval round and exit.
            doc["trainer"].update(mode="eval", zero_stage=0)
            eval_job = tmp / "eval.yaml"
            eval_job.write_text(yaml.safe_dump(doc))
            eval_jsonl = tmp / "eval-metrics.jsonl"
            evaluator = ServiceProcess.kuberl(
                "trainer",
                eval_job,
                tmp,
                name="evaluator",
                env={"KUBERL_METRICS_JSONL": str(eval_jsonl)},
            )
            eval_only_rounds, eval_code, eval_log = _until_exit(client, evaluator, 120)
            eval_stats = client.stats()
            eval_version = download_snapshot(ws.address)[0]
    return {
        "tmp": tmp,
        "code": code,
        "log": log,
        "rows": _rows(jsonl) if jsonl.exists() else [],
        "stats": stats,
        "version": version,
        "published": published,
        "eval_rounds": eval_rounds,
        "eval_only": {
            "code": eval_code,
            "log": eval_log,
            "rows": _rows(eval_jsonl) if eval_jsonl.exists() else [],
            "rounds": eval_only_rounds,
            "stats": eval_stats,
            "version": eval_version,
        },
    }


def test_the_trainer_trains_total_steps_on_buffer_batches_and_exits_0(run) -> None:  # type: ignore[no-untyped-def]
    steps = [r for r in run["rows"] if r.get("kind") == "rl"]
    assert run["code"] == 0, run["log"][-4000:]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert "world_size=2" in run["log"] and "zero_stage=3" in run["log"]
    assert [r["policy_version"] for r in steps] == [2, 3, 4]  # version 1: the SFT warm start
    for r in steps:
        assert np.isfinite([r["loss/total"], r["loss/policy"], r["grad_norm"], r["kl/ref"]]).all()
        assert r["grad_norm"] > 0
        # the engine logprobs (~log 0.01) differ from the tiny model's: a mismatch is reported
        assert r["mismatch/kl"] > 0 and r["mismatch/ratio_max"] > r["mismatch/ratio_min"]


def test_batches_hold_whole_groups_oldest_first_and_unusable_groups_are_left_out(run) -> None:  # type: ignore[no-untyped-def]
    # batches: [bad, G0] -> G0 alone; [G1, G2]; [G3] (a partial batch after batch_wait_seconds)
    steps = [r for r in run["rows"] if r.get("kind") == "rl"]
    expected = [np.mean(REWARDS[0]), np.mean(REWARDS[1] + REWARDS[2]), np.mean(REWARDS[3])]
    assert [r["reward/mean"] for r in steps] == pytest.approx(expected)
    assert [r["batch/groups"] for r in steps] == [1.0, 2.0, 1.0]
    assert [r["batch/rejected_groups"] for r in steps] == [1.0, 0.0, 0.0]
    assert "reason=token_out_of_vocabulary" in run["log"]


def test_batches_are_acked_after_the_step_and_the_policy_version_advances(run) -> None:  # type: ignore[no-untyped-def]
    stats = run["stats"]
    assert (stats.batches_unacked, stats.groups_pending, stats.policy_version) == (0, 0, 4)


def test_weight_sync_holds_the_trainers_final_weights(run) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    exported = load_file(str(run["tmp"] / "ckpt" / "step-000003" / "hf" / "model.safetensors"))
    published = run["published"]
    assert run["version"] == 4
    assert set(exported) == set(published)
    assert all((published[k] == exported[k]).all() for k in exported)


def test_every_third_version_is_published_and_the_current_one_before_evals_and_at_the_end(
    run,
) -> None:  # type: ignore[no-untyped-def]
    # publish_every 3: SFT makes version 1 (published for the first eval round), RL steps make
    # 2 (skipped), 3 (published; the eval after step 2 finds it there) and 4 (published for the
    # final eval round).
    published = re.findall(r"event=weights\.published version=(\d+)", run["log"])  # the publisher's
    assert [int(v) for v in published] == [1, 3, 4], published


def test_an_sft_warm_start_trains_on_the_buffers_rejection_sampling_stream(run) -> None:  # type: ignore[no-untyped-def]
    sft = [r for r in run["rows"] if r.get("kind") == "sft"]
    assert [(r["step"], r["policy_version"], r["batch/sequences"]) for r in sft] == [(0, 1, 2.0)]
    assert np.isfinite(sft[0]["loss/sft"]) and sft[0]["loss/sft"] > 0


def test_eval_rounds_at_start_and_end_report_accuracy_per_dataset(run) -> None:  # type: ignore[no-untyped-def]
    evals = [r for r in run["rows"] if r.get("kind") == "eval"]
    # eval_every 2 of 3 steps: at the start, after step 2, and for the final weights.
    assert run["eval_rounds"] == [0, 1, 2]
    assert [(r["round"], r["step"]) for r in evals] == [(0, 0), (1, 2), (2, 3)]
    assert all(r["eval/eval/accuracy"] == 0.25 and r["eval/accuracy"] == 0.25 for r in evals)
    assert all(r["eval/eval/pass_at_n"] == 1.0 and r["eval/missing_groups"] == 0 for r in evals)


def test_eval_mode_runs_one_round_from_the_checkpoint_and_trains_and_publishes_nothing(run) -> None:  # type: ignore[no-untyped-def]
    ev = run["eval_only"]
    rows = ev["rows"]
    assert ev["code"] == 0, ev["log"][-3000:]
    # The checkpoint's cursor had three rounds behind it: this is round 3, on version 4's weights.
    assert ev["rounds"] == [3] and [(r["kind"], r["round"]) for r in rows] == [("eval", 3)]
    assert rows[0]["eval/accuracy"] == 0.25 and rows[0]["eval/missing_groups"] == 0
    assert (ev["stats"].policy_version, ev["stats"].batches_unacked, ev["version"]) == (4, 0, 4)
    assert "event=weights.published" not in ev["log"]
