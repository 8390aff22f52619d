"""The trainer's pure pieces: token-budget micro-batches, rank sharding, collation into model and
response-aligned views, metric merging across micro-batches and ranks, eval accuracy per
dataset, SFT data, checkpoint cursor and RNG round trip, and `kuberl model init`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kuberl.common.trajectory import Group, Trajectory
from kuberl.trainer import checkpoint as ckpt
from kuberl.trainer.batching import TrainingSequence, collate, micro_batches, shard
from kuberl.trainer.evaluation import eval_metrics
from kuberl.trainer.loop import Trainer
from kuberl.trainer.sft import SFTDataError, epoch_batches, read_pairs
from kuberl.trainer.telemetry import merge_metrics


def _sample(index: int, prompt: int, response: int) -> TrainingSequence:
    return TrainingSequence(
        prompt_ids=np.arange(1, prompt + 1),
        response_ids=np.arange(100, 100 + response),
        loss_mask=np.ones(response, dtype=np.float32),
        arrays={"adv": np.full(response, float(index), dtype=np.float32)},
        index=index,
    )


def test_micro_batches_keep_padded_size_within_the_token_budget() -> None:
    samples = [_sample(i, 3, n) for i, n in enumerate([1, 9, 4, 2, 7, 5, 3, 8])]
    groups = micro_batches(samples, budget_tokens=24)
    assert sorted(s.index for g in groups for s in g) == list(range(8))
    assert all(max(s.length for s in g) * len(g) <= 24 for g in groups)
    # lengths 12 11 10 8 7 6 5 4, longest first; adding one more would exceed 24 each time
    assert [[s.length for s in g] for g in groups] == [[12, 11], [10, 8], [7, 6, 5], [4]]


def test_a_sequence_longer_than_the_budget_gets_a_micro_batch_of_its_own() -> None:
    groups = micro_batches([_sample(0, 2, 30), _sample(1, 2, 2)], budget_tokens=16)
    assert [[s.index for s in g] for g in groups] == [[0], [1]]


def test_shards_cover_the_batch_once_with_balanced_tokens() -> None:
    samples = [_sample(i, 2, n) for i, n in enumerate(range(1, 11))]
    parts = [shard(samples, r, 3) for r in range(3)]
    assert sorted(s.index for p in parts for s in p) == list(range(10))
    tokens = [sum(s.length for s in p) for p in parts]
    assert max(tokens) - min(tokens) <= 12


def test_collate_aligns_model_outputs_with_response_tokens() -> None:
    a, b = _sample(0, 2, 3), _sample(1, 4, 1)
    mb = collate([a, b], pad_id=0, device=torch.device("cpu"), names=["adv"])
    # a model output at position t "predicts" input_ids[t + 1]
    fake_outputs = mb.input_ids[:, 1:].float()  # [b, T-1]
    responses = mb.to_response(fake_outputs)  # [b, R]
    assert mb.input_ids.tolist() == [[1, 2, 100, 101, 102], [1, 2, 3, 4, 100]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert (responses * mb.mask).tolist() == [[100, 101, 102], [100, 0, 0]]
    assert mb.arrays["adv"].tolist() == [[0, 0, 0], [1, 0, 0]]
    assert mb.num_tokens == 4 and mb.indices == [0, 1]


def test_merged_metrics_add_shares_keep_extremes_and_weight_the_rest_by_tokens() -> None:
    records = [
        ({"loss/policy": 0.25, "entropy": 1.0, "policy/ratio_max": 1.5, "clip": 0.0}, 10),
        ({"loss/policy": 0.5, "entropy": 2.0, "policy/ratio_max": 1.2, "clip": 1.0}, 30),
    ]
    merged = merge_metrics(records)
    assert merged == {"loss/policy": 0.75, "entropy": 3.0, "policy/ratio_max": 1.5, "clip": 0.75}


def test_a_micro_batch_without_trained_tokens_leaves_the_extremes_alone() -> None:
    # All-masked rows report ratio_min and ratio_max 0 (nothing to take extremes of): the
    # step's ratio_min was then 0.
    records = [
        ({"policy/ratio_min": 0.8, "policy/ratio_max": 1.3, "mismatch/ratio_min": 0.9}, 12),
        ({"policy/ratio_min": 0.0, "policy/ratio_max": 0.0, "mismatch/ratio_min": 0.0}, 0),
    ]
    assert merge_metrics(records) == {
        "policy/ratio_min": 0.8,
        "policy/ratio_max": 1.3,
        "mismatch/ratio_min": 0.9,
    }


def test_eval_accuracy_is_reported_per_dataset_and_overall() -> None:
    def group(prompt_id: str, rewards: list[float]) -> Group:
        ts = [
            Trajectory([1], [2], [-1.0], prompt_id=prompt_id, sample_index=i, reward=r)
            for i, r in enumerate(rewards)
        ]
        return Group(prompt_id, 0, ts)

    groups = [group("gsm8k:0", [1, 0]), group("gsm8k:1", [0, 0]), group("math:0", [1, 1])]
    m = eval_metrics(groups, threshold=0.5, expected=4)
    assert m["eval/gsm8k/accuracy"] == 0.25 and m["eval/gsm8k/pass_at_n"] == 0.5
    assert m["eval/math/accuracy"] == 1.0 and m["eval/accuracy"] == 0.5
    assert m["eval/missing_groups"] == 1.0


def test_sft_pairs_are_read_and_a_bad_line_is_named(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "1+1=", "response": "2"}\n\n{"prompt": "a", "completion": "b"}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "response": "2"}\n{"prompt": 3}\n')
    assert read_pairs(good) == [("1+1=", "2"), ("a", "b")]
    with pytest.raises(SFTDataError, match=r"bad.jsonl:2: expected string fields"):
        read_pairs(bad)


def test_sft_pairs_are_read_from_parquet_and_a_file_that_is_not_data_is_named(
    tmp_path: Path,
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "a"], "response": ["2", "b"]}), table)
    notes = tmp_path / "notes.txt"
    notes.write_text('{"prompt": "1+1=", "response": "2"}\n')
    assert read_pairs(table) == [("1+1=", "2"), ("a", "b")]
    with pytest.raises(SFTDataError, match=r"notes.txt: unsupported dataset format '.txt'"):
        read_pairs(notes)


def test_sft_epochs_are_reshuffled_and_cover_every_example() -> None:
    samples = [_sample(i, 1, 1) for i in range(6)]
    it = epoch_batches(samples, batch_size=3, seed=0)
    (e0, b0), (_, b1), (e1, b2) = next(it), next(it), next(it)
    seen = sorted(int(s.prompt_ids.sum()) for s in b0 + b1)
    assert (e0, e1) == (0, 1) and seen == [1] * 6 and len(b2) == 3


def test_checkpoint_cursor_and_rng_round_trip(tmp_path: Path) -> None:
    cursor = ckpt.Cursor(step=7, policy_version=9, epoch=1, metrics={"loss/total": 0.5})
    path = tmp_path / ckpt.tag_for(7)
    ckpt.write_rank_files(path, rank=0)
    expected = torch.rand(3)
    ckpt.write_cursor(path, cursor)
    ckpt.commit(tmp_path, path, keep=2)
    torch.rand(5)  # move the generator on
    restored = ckpt.read_cursor(ckpt.latest(tmp_path), rank=0)  # type: ignore[arg-type]
    assert restored == cursor
    assert torch.equal(torch.rand(3), expected)


def test_a_checkpoint_folder_never_finished_is_deleted_at_the_next_commit(tmp_path: Path) -> None:
    # A trainer killed while saving step 37 left its shards without a cursor.json: pruning
    # looked only at finished folders, so such leftovers (the bulk of a save) piled up.
    torn = tmp_path / ckpt.tag_for(37)
    torn.mkdir()
    (torn / "mp_rank_00_model_states.pt").write_bytes(b"x" * 1000)
    for step in (40, 50):
        path = tmp_path / ckpt.tag_for(step)
        ckpt.write_rank_files(path, rank=0)
        ckpt.write_cursor(path, ckpt.Cursor(step=step))
        ckpt.commit(tmp_path, path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000040", "step-000050"]


def test_only_the_newest_checkpoints_are_kept_and_latest_names_the_last(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        path = tmp_path / ckpt.tag_for(step)
        path.mkdir()
        ckpt.write_cursor(path, ckpt.Cursor(step=step))
        ckpt.commit(tmp_path, path, keep=2)
    half = tmp_path / ckpt.tag_for(8)  # a save killed before its cursor was written
    half.mkdir()
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-000004",
        "step-000006",
        "step-000008",
    ]
    assert ckpt.latest(tmp_path) == tmp_path / "step-000006"


def test_a_second_checkpoint_at_one_step_gets_a_folder_of_its_own(tmp_path: Path) -> None:
    # CheckpointNow right after the periodic checkpoint, or at every SFT warm-up step (step 0):
    # never written into the folder `latest` names; pruning orders the folders by suffix.
    names = []
    for step in (6, 6, 6, 7):
        tag = ckpt.fresh_tag(tmp_path, step)
        names.append(tag)
        (tmp_path / tag).mkdir()
        ckpt.write_cursor(tmp_path / tag, ckpt.Cursor(step=step))
        ckpt.commit(tmp_path, tmp_path / tag, keep=3)
    assert names == ["step-000006", "step-000006.1", "step-000006.2", "step-000007"]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == names[1:]
    (tmp_path / "step-000008").mkdir()  # a save killed before its cursor: the name is reused
    (tmp_path / "step-000009.x").mkdir()  # not a suffix of ours: no bearing on the next name
    assert (ckpt.fresh_tag(tmp_path, 8), ckpt.fresh_tag(tmp_path, 9)) == (
        "step-000008",
        "step-000009",
    )
    assert ckpt.latest(tmp_path) == tmp_path / "step-000007"


def test_a_checkpoint_is_on_disk_before_latest_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What every rank wrote (files and folders) is fsynced before the commit, and `latest` is
    # fsynced before its rename and its folder after: a lost node never leaves `latest` naming
    # files the disk never got.
    import os

    synced: list[Path] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    path = tmp_path / "step-000001"
    (path / "policy").mkdir(parents=True)
    (path / "policy" / "shard.pt").write_bytes(b"weights")
    ckpt.write_cursor(path, ckpt.Cursor(step=1))
    ckpt.sync_tree(path)
    before_commit = len(synced)
    ckpt.commit(tmp_path, path, keep=2)
    expected = {path / "policy" / "shard.pt", path / "cursor.json", path / "policy", path}
    assert expected <= set(synced[:before_commit])
    assert synced[before_commit:] == [tmp_path / ".latest.tmp", tmp_path]


def test_a_leftover_newer_than_the_committed_checkpoint_never_pushes_it_out(tmp_path: Path) -> None:
    # A trainer died after writing step 200's cursor, before committing it; the one resumed
    # from step 100 commits step 150 with keep_checkpoints 1: step 150 stays, 200 goes.
    for step in (100, 200, 150):
        path = tmp_path / ckpt.tag_for(step)
        path.mkdir()
        ckpt.write_cursor(path, ckpt.Cursor(step=step))
        if step != 200:
            ckpt.commit(tmp_path, path, keep=1)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000150"]
    assert ckpt.latest(tmp_path) == tmp_path / "step-000150"


def test_a_checkpoint_below_an_earlier_runs_steps_is_never_pruned_under_latest(
    tmp_path: Path,
) -> None:
    # A job started with `resume: false` in a folder an earlier run left at steps 90-100
    # (latest 100): its first checkpoint, step 5, sorts below them, and must stay with `latest`
    # naming it; keep 3 keeps the newest two of the earlier ones beside it.
    for step in (90, 95, 100, 5):
        path = tmp_path / ckpt.tag_for(step)
        path.mkdir()
        ckpt.write_cursor(path, ckpt.Cursor(step=step))
        ckpt.commit(tmp_path, path, keep=3)
    assert ckpt.latest(tmp_path) == tmp_path / "step-000005"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-000005",
        "step-000095",
        "step-000100",
    ]
    path = tmp_path / ckpt.tag_for(10)  # its next: the earlier run's folders are leftovers now
    path.mkdir()
    ckpt.write_cursor(path, ckpt.Cursor(step=10))
    ckpt.commit(tmp_path, path, keep=3)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000005", "step-000010"]


def test_a_leftover_at_the_step_of_the_next_checkpoint_goes_too(tmp_path: Path) -> None:
    # latest is step 40; a dead trainer left step 50 uncommitted; the resumed one writes its
    # step 50 as step-000050.1, which sorts after the leftover: keep 2 keeps 40 and 50.1.
    for name in ("step-000040", "step-000050"):
        (tmp_path / name).mkdir()
        ckpt.write_cursor(tmp_path / name, ckpt.Cursor(step=int(name[-2:])))
        if name == "step-000040":
            ckpt.commit(tmp_path, tmp_path / name, keep=2)
    tag = ckpt.fresh_tag(tmp_path, 50)
    assert tag == "step-000050.1"
    (tmp_path / tag).mkdir()
    ckpt.write_cursor(tmp_path / tag, ckpt.Cursor(step=50))
    ckpt.commit(tmp_path, tmp_path / tag, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000040", "step-000050.1"]


def test_model_init_builds_an_hf_folder_with_a_tokenizer_trained_on_the_data(
    tmp_path: Path,
) -> None:
    from kuberl.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text(
        "\n".join(json.dumps({"q": f"what is {i} plus {i}?", "a": str(2 * i)}) for i in range(50))
    )
    out = tmp_path / "model"
    assert main(["model", "init", str(out), "--tokenizer", "bpe", "--data", str(data)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "token_sum"])
def test_micro_batch_losses_with_the_global_count_add_up_to_the_whole_batch_loss(agg: str) -> None:
    from kuberl.common.config import AlgorithmConfig
    from kuberl.trainer import algorithms as algo
    from kuberl.trainer.rl import global_normaliser

    rng = np.random.default_rng(0)
    rows = [_sample(i, 2, n) for i, n in enumerate([5, 2, 7, 3, 4, 6])]
    for s in rows:
        n = s.response_length
        s.arrays = {
            "lp": rng.normal(-2, 0.3, n).astype(np.float32),
            "old": rng.normal(-2, 0.3, n).astype(np.float32),
            "adv": rng.normal(0, 1, n).astype(np.float32),
        }
        s.loss_mask[0] = 0.0  # a masked (tool output) token
    alg = AlgorithmConfig(loss_agg=agg, importance={"mode": "none"})
    count, cfg = global_normaliser(alg, rows)
    cpu = torch.device("cpu")

    def loss(samples: list[TrainingSequence], global_count: float | None) -> float:
        mb = collate(samples, 0, cpu, ["lp", "old", "adv"])
        a = mb.arrays
        value, _ = algo.policy_loss_and_metrics(
            cfg, a["lp"], a["old"], a["old"], a["adv"], mb.mask, global_count=global_count
        )
        return float(value)

    whole = loss(rows, None)
    parts = sum(loss(g, count) for g in micro_batches(rows, budget_tokens=18))
    assert len(micro_batches(rows, budget_tokens=18)) >= 3
    assert parts == pytest.approx(whole, rel=1e-6)


def test_a_group_trained_before_is_left_out_when_it_comes_back_in_another_batch() -> None:
    # A Redis host crash can lose the last second of writes: a batch's issue and its groups'
    # acks, so groups already trained come back in a batch with a new id. The cursor keeps the
    # keys of the last trained groups (in checkpoints too) and the trainer leaves those out.

    from kuberl.common.trajectory import Group
    from kuberl.trainer.batch import Rejection, usable_groups
    from tests.integration.buffer_support import make_group

    cursor = ckpt.Cursor()
    cursor.note_trained("train-1", ["p:1@0", "p:2@0"])
    groups = [Group.from_proto(make_group(p, 0)) for p in ("p:1", "p:3")]
    groups.append(Group.from_proto(make_group("p:2", 1)))  # the same prompt, the next epoch
    rejected: list[Rejection] = []
    kept = usable_groups(groups, 1000, rejected=rejected, trained=set(cursor.trained_groups))
    assert [f"{g.prompt_id}@{g.epoch}" for g in kept] == ["p:3@0", "p:2@1"]
    assert rejected == [Rejection(key="p:1@0", reason="already_trained")]
    # Kept across a checkpoint, and bounded.
    restored = ckpt.Cursor.from_json(cursor.to_json())
    restored.note_trained("train-2", [f"x:{i}@0" for i in range(ckpt.TRAINED_GROUPS_KEPT)])
    assert (restored.trained_groups[0], len(restored.trained_groups)) == (
        "x:0@0",
        ckpt.TRAINED_GROUPS_KEPT,
    )


def test_the_cursor_keeps_the_ids_of_every_batch_a_checkpoint_acknowledges() -> None:
    # A trainer acknowledges the batches of up to `checkpoint_every` steps after a checkpoint;
    # a crash before those Acks re-delivers them all, and the checkpoint must name every one
    # (else one would be trained twice), also with checkpoint_every above the default bound.
    cursor = ckpt.Cursor()
    every = ckpt.TRAINED_BATCHES_KEPT + 500
    for i in range(every + 10):
        cursor.note_trained(f"train-{i}", keep=every)
    assert (len(cursor.trained_batches), cursor.trained_batches[-1]) == (
        every,
        f"train-{every + 9}",
    )
    for i in range(3):
        cursor.note_trained(f"sft-{i}", keep=2)  # never fewer than the default bound
    assert len(cursor.trained_batches) == ckpt.TRAINED_BATCHES_KEPT


def _trainer(**trainer: object) -> Trainer:
    from kuberl.common.config import parse_job_config
    from kuberl.trainer.distributed import DistInfo

    config = parse_job_config({"trainer": trainer}, env={})
    return Trainer(config, DistInfo(0, 1, 0, torch.device("cpu")))


def test_a_batch_is_held_while_no_checkpoint_has_its_step_warm_up_steps_included() -> None:
    # The SFT warm-up of an RL job counts its own steps (`step` stays 0): after a warm-up
    # checkpoint, the next warm-up steps are not in it and their batches must be held too.
    from kuberl.trainer.checkpointer import position

    trainer = _trainer(checkpoint_every=2)

    def hold(batch_id: str, t: Trainer = trainer) -> bool:
        return t.delivery.should_hold(batch_id, t.checkpoints.unsaved(t.cursor))

    decisions = [hold("sft-0")]  # nothing trained yet
    trainer.cursor.sft_step = 1
    decisions.append(hold("sft-1"))
    trainer.cursor.sft_step = 2
    trainer.checkpoints.saved_at = position(trainer.cursor)  # the warm-up checkpoint
    decisions.append(hold("sft-2"))
    trainer.cursor.sft_step = 3
    decisions.append(hold("sft-3"))
    trainer.cursor.step = 1  # the first RL step, after the warm-up
    decisions.append(hold("train-1"))
    decisions.append(hold(""))  # a step from a file: no batch
    assert decisions == [False, True, False, True, True, False]
    assert trainer.delivery.uncommitted == ["sft-1", "sft-3", "train-1"]
    for settings in (
        {"checkpoint_every": 0},
        {"checkpoint_every": 2, "ack_after_checkpoint": False},
    ):
        other = _trainer(**settings)
        other.cursor.step = 1
        assert (hold("train-1", other), other.delivery.uncommitted) == (False, [])


def test_acknowledging_after_a_checkpoint_tries_each_batch_once_and_keeps_the_failures() -> None:
    # A buffer that cannot be reached while a checkpoint commits: one try per batch, no retry
    # loop (the other ranks wait in their next collective), and every batch that failed is
    # tried again later. The last trained batch, still to be sent with the next GetBatch, goes
    # as a plain Ack.
    import time

    import grpc

    from kuberl.api.buffer.v1 import buffer_pb2_grpc
    from kuberl.common.redis_server import PortReservation

    ports = PortReservation()
    channel = grpc.insecure_channel(f"127.0.0.1:{ports.take()}")  # bound, never listening
    try:
        delivery = _trainer(checkpoint_every=4).delivery
        delivery.buffer = buffer_pb2_grpc.BufferServiceStub(channel)
        delivery.uncommitted = ["train-a", "train-b", "train-c"]
        delivery.unacked, delivery.unacked_hold = "train-c", True
        started = time.monotonic()
        delivery.commit_held()
        seconds = time.monotonic() - started
    finally:
        channel.close()
        ports.release()
    assert (delivery.uncommitted, delivery.unacked, delivery.unacked_hold) == (
        ["train-a", "train-b"],
        "train-c",
        False,
    )
    assert seconds < 10


def test_an_eval_round_follows_a_trained_step_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # A pass of the loop that trains nothing (CheckpointNow; a re-delivered batch the checkpoint
    # has, only acknowledged; a batch whose groups were all left out) leaves the step where it
    # was: at a step that is a multiple of eval_every it must not start another eval round.
    # The trainer's own step, eval and publish are stand-ins here; `_run` is the real one.
    trainer = _trainer(total_steps=4, eval_every=2, checkpoint_every=0)
    trainer.cursor.eval_round = 1  # the round before training is done
    advances = iter([True, True, False, True, True])  # the third pass trains nothing
    evaluated: list[int] = []

    def one_step(sft: bool) -> bool:
        trainer.cursor.step += next(advances)
        return True

    monkeypatch.setattr(trainer, "_one_step", one_step)
    monkeypatch.setattr(trainer, "_evaluate", lambda: evaluated.append(trainer.cursor.step))
    monkeypatch.setattr(trainer.publisher, "publish_current", lambda version: None)
    monkeypatch.setattr(trainer, "_checkpoint", lambda: None)  # the job's final checkpoint
    trainer._run()
    assert (trainer.cursor.step, evaluated) == (4, [2, 4])


def test_step_flops_count_every_pass_that_ran_and_the_head_at_response_positions_only() -> None:
    from kuberl.trainer.telemetry import step_flops

    # Body 1,000 params, head 100, 50 tokens of which 20 are response: a forward is
    # 2 * (1000 * 50 + 100 * 20) = 104,000 FLOPs.
    sft = step_flops(
        body_params=1000, head_params=100, tokens=50, response_tokens=20,
        training_passes=1, forward_passes=0,
    )  # fmt: skip
    # PPO: 2 epochs (6 forward-equivalents each), a recompute, a reference forward, and a critic
    # of 800 params: its value forward and 2 training passes, 2 * 800 * 50 * (1 + 6) = 560,000.
    ppo = step_flops(
        body_params=1000, head_params=100, tokens=50, response_tokens=20,
        training_passes=2, forward_passes=1, reference=True,
        critic_body_params=800, critic_training_passes=2,
    )  # fmt: skip
    assert (sft, ppo) == (3 * 104_000, 104_000 * (6 + 1 + 1) + 560_000)


def test_the_policys_head_is_counted_apart_and_a_tied_embedding_is_no_matmul(
    tmp_path: Path,
) -> None:
    from kuberl.common.modelbuild import build_model
    from kuberl.trainer.engine import PolicyModel, load_causal_lm
    from kuberl.trainer.telemetry import policy_params

    path = build_model(tmp_path / "m", arch="qwen2", size="tiny", tokenizer="digits", seed=0)
    hf = load_causal_lm(path, torch.float32)
    vocab, hidden = hf.get_output_embeddings().weight.shape
    total = sum(p.numel() for p in hf.parameters())  # the tied matrix counted once
    body, head = policy_params(PolicyModel(hf))
    assert hf.config.tie_word_embeddings
    assert (body, head) == (total - vocab * hidden, vocab * hidden)


@pytest.mark.parametrize(
    ("mode", "sampled", "head"), [("sft", 0.5, 1.0), ("rl", 0.5, 0.5), ("rl", 0.0, 1.0)]
)
def test_sft_fits_the_model_at_temperature_one_and_rl_at_the_engines(
    mode: str, sampled: float, head: float
) -> None:
    # mode: sft once trained on logits / 0.5: the exported model was miscalibrated at 1.
    from kuberl.common.config import parse_job_config
    from kuberl.trainer.models import head_temperature

    job = {"trainer": {"mode": mode}, "rollout": {"sampling": {"temperature": sampled}}}
    if sampled == 0:
        job["buffer"] = {"dynamic_sampling": False}
    assert head_temperature(parse_job_config(job, env={})) == head


def test_a_collective_may_wait_out_a_whole_eval_round_and_more() -> None:
    # Other ranks wait in a barrier while rank 0 runs an eval round of up to
    # eval_timeout_seconds (600 by default): DeepSpeed's 10-minute default killed the job.
    from kuberl.common.config import parse_job_config
    from kuberl.trainer.distributed import collective_timeout_seconds

    default = collective_timeout_seconds(parse_job_config({}, env={}))
    long_eval = parse_job_config({"trainer": {"eval_timeout_seconds": 3600}}, env={})
    assert (default, collective_timeout_seconds(long_eval)) == (1800.0, 4200.0)


def test_a_steps_mfu_counts_the_passes_its_mode_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The GPU-only branch of the step's speed figures, run on the CPU with a stand-in peak.
    from types import SimpleNamespace

    from kuberl.common.config import AlgorithmConfig
    from kuberl.common.modelbuild import build_model
    from kuberl.trainer import telemetry
    from kuberl.trainer.batch import Batch
    from kuberl.trainer.distributed import DistInfo
    from kuberl.trainer.engine import PolicyModel, load_causal_lm
    from kuberl.trainer.models import Models

    path = build_model(tmp_path / "m", arch="qwen2", size="tiny", tokenizer="digits", seed=0)
    policy = PolicyModel(load_causal_lm(path, torch.float32))
    models = Models(policy=SimpleNamespace(module=policy))  # type: ignore[arg-type]
    monkeypatch.setattr(telemetry, "peak_flops", lambda device: 1e12)
    batch = Batch(samples=[_sample(0, 3, 5), _sample(1, 2, 4)])
    alg = AlgorithmConfig(ppo_epochs=2, recompute_old_logprobs=True)
    dist = DistInfo(0, 1, 0, torch.device("cpu"))
    body, head = telemetry.policy_params(policy)
    by_mode = {}
    for sft in (True, False):
        flops = telemetry.step_flops(
            body_params=body, head_params=head, tokens=14, response_tokens=9,
            training_passes=1 if sft else 2, forward_passes=0 if sft else 1,
        )  # fmt: skip
        by_mode[sft] = telemetry.speed(batch, 2.0, models, alg, sft, dist)["mfu"] / flops
    assert by_mode == {True: pytest.approx(1 / 2e12), False: pytest.approx(1 / 2e12)}
