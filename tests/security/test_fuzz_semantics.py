"""Structurally valid but wrong requests, against the real services (tests/security/cluster).

Each request parses, names real things and is wrong in exactly one way. The buffer is given
groups for prompts it really leased, each with one defect (a NaN, a length, a dtype, an index);
reward gets samples with one bad field; weight-sync gets snapshot uploads of announced versions
with one corrupted chunk. All must be refused with INVALID_ARGUMENT (or the documented code),
counted, and leave nothing behind: the buffer stores no group, weight-sync's version does not
move. A correct request of the same kind then succeeds, so the refusals are not an accident of
the set-up. Messages over the limit are refused by gRPC itself with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.api.buffer.v1 import buffer_pb2_grpc
from kuberl.api.common.v1 import trajectory_pb2 as tpb
from kuberl.api.reward.v1 import reward_pb2 as rpb
from kuberl.api.reward.v1 import reward_pb2_grpc
from kuberl.api.weight_sync.v1 import weight_sync_pb2 as wpb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc
from kuberl.common.trajectory import encode_array
from tests.integration.buffer_support import make_group
from tests.security.cluster import GROUP_SIZE, MAX_MESSAGE_BYTES, Cluster, wait_for
from tests.security.fuzzing import (
    NEVER,
    RawCaller,
    fuzz_settings,
    methods,
    report,
    rpc_errors,
    uncounted,
)

C = grpc.StatusCode
NONFINITE = st.sampled_from([math.nan, math.inf, -math.inf])


class _Deep(str):
    """A JSON text nested 100,000 levels deep (Python's json raises RecursionError on it)."""

    def __repr__(self) -> str:
        return "<JSON nested 100000 deep>"


DEEP_JSON = _Deep("[" * 100_000 + "]" * 100_000)


# ---------------------------------------------------------------- buffer: bad groups


def _tensor_values(t: tpb.Tensor, values: np.ndarray) -> None:
    t.CopyFrom(encode_array(values))


def _set_array(traj: tpb.Trajectory, name: str, **changes: Any) -> None:
    tensor = getattr(traj, name)
    for key, value in changes.items():
        if key == "shape":
            del tensor.shape[:]
            tensor.shape.extend(value)
        else:
            setattr(tensor, key, value)


def _logprobs(traj: tpb.Trajectory) -> np.ndarray:
    return np.frombuffer(traj.rollout_logprobs.data, dtype="<f4").copy()


Corruption = Callable[[tpb.Group, tpb.Trajectory, Any], None]
CORRUPTIONS: dict[str, tuple[Corruption, st.SearchStrategy[Any]]] = {
    "reward": (lambda g, t, v: setattr(t, "reward", v), NONFINITE),
    "reward_breakdown": (lambda g, t, v: t.reward_breakdown.__setitem__("gsm8k", v), NONFINITE),
    "rollout_logprob": (
        lambda g, t, v: _tensor_values(t.rollout_logprobs, np.append(_logprobs(t)[1:], v)),
        NONFINITE.map(lambda x: np.float32(x)),
    ),
    "timings": (
        lambda g, t, v: setattr(t.timings, v[0], v[1]),
        st.tuples(
            st.sampled_from(
                ["queued_seconds", "generate_seconds", "score_seconds", "finished_unix"]
            ),
            NONFINITE,
        ),
    ),
    "logprobs_length": (
        lambda g, t, v: _set_array(t, "rollout_logprobs", data=t.rollout_logprobs.data[: 4 * v]),
        st.sampled_from([0, 1, 7]),
    ),
    "mask_length": (
        lambda g, t, v: _set_array(t, "loss_mask", data=(t.loss_mask.data + b"\x01" * 4)[:v]),
        st.sampled_from([0, 3, 9, 12]),
    ),
    "token_dtype": (
        lambda g, t, v: _set_array(t, "response_token_ids", dtype=v),
        st.sampled_from(["float32", "bool", "uint8", "float16", "bfloat16", "int128", ""]),
    ),
    "logprob_dtype": (
        lambda g, t, v: _set_array(t, "rollout_logprobs", dtype=v),
        st.sampled_from(["int32", "uint8", "int128", "bool"]),
    ),
    "mask_dtype": (
        lambda g, t, v: _tensor_values(t.loss_mask, np.ones(8, dtype=v)),
        st.sampled_from(["float32", "int32", "float64"]),
    ),
    "mask_values": (
        lambda g, t, v: _tensor_values(t.loss_mask, np.full(8, v, dtype=np.uint8)),
        st.sampled_from([2, 7, 255]),
    ),
    "negative_token": (
        lambda g, t, v: _tensor_values(
            t.response_token_ids,
            np.append(np.frombuffer(t.response_token_ids.data, "<i4")[1:], v).astype(np.int32),
        ),
        st.sampled_from([-1, -(2**31)]),
    ),
    "shape": (
        lambda g, t, v: _set_array(t, "response_token_ids", shape=v),
        st.sampled_from([[9], [-8], [2, 4], [4, 2], [1, 8], [0]]),
    ),
    "ragged_bytes": (
        lambda g, t, v: _set_array(t, v, data=getattr(t, v).data[:-1]),
        st.sampled_from(["prompt_token_ids", "response_token_ids", "rollout_logprobs"]),
    ),
    "empty_prompt_tokens": (
        lambda g, t, v: _set_array(t, "prompt_token_ids", data=b""),
        st.just(None),
    ),
    "sample_index": (
        lambda g, t, v: setattr(t, "sample_index", v),
        st.sampled_from([-1, GROUP_SIZE, 2**31 - 1, -(2**31)]),
    ),
    "duplicate_sample": (
        lambda g, t, v: g.trajectories[1].CopyFrom(g.trajectories[0]),
        st.just(None),
    ),
    "group_size": (
        lambda g, t, v: g.trajectories.pop() if v else g.trajectories.add().CopyFrom(t),
        st.booleans(),
    ),
    "other_prompt": (
        lambda g, t, v: setattr(t, "prompt_id", v and g.prompt_id + v),
        st.sampled_from(["", "0", "#other"]),
    ),
    "epoch": (lambda g, t, v: setattr(t, "epoch", v), st.sampled_from([-1, 1, 2**63 - 1])),
    "finish_reason": (
        lambda g, t, v: setattr(t, "finish_reason", v),
        st.sampled_from([0, 5, 99, -1, 2**31 - 1]),
    ),
    "metadata_json": (
        lambda g, t, v: setattr(t, "metadata_json", v),
        st.sampled_from(["not json", "[1, 2]", '"text"', "{", DEEP_JSON]),
    ),
    "policy_version": (
        lambda g, t, v: (
            setattr(t, "policy_version_start", v[0]),
            setattr(t, "policy_version_end", v[1]),
        ),
        st.sampled_from([(-1, 0), (0, -1), (5, 3), (-(2**63), 0)]),
    ),
}


def _stored_groups(cluster: Cluster, job: str) -> dict[str, int]:
    """What the buffer holds in Redis for each stream kind: stream entries and payloads."""
    client = redis.Redis.from_url(cluster.redis.url)  # the URL carries the password
    prefix = f"kuberl:{{{job}}}:"
    out = {}
    for kind in ("train", "eval", "sft"):
        out[f"groups:{kind}"] = int(client.xlen(prefix + f"groups:{kind}"))
        out[f"payloads:{kind}"] = int(client.hlen(prefix + f"payloads:{kind}"))
    client.close()
    return out


def _accepted(stub: buffer_pb2_grpc.BufferServiceStub) -> int:
    """Training groups the buffer has ever accepted (a counter: training does not lower it)."""
    return int(stub.GetStats(bpb.GetStatsRequest(), timeout=10).counters.get("train:accepted", 0))


@pytest.fixture
def buffer_stub(cluster: Cluster) -> Iterator[buffer_pb2_grpc.BufferServiceStub]:
    with cluster.channel("buffer") as channel:
        yield buffer_pb2_grpc.BufferServiceStub(channel)


def test_groups_with_one_defect_for_leased_prompts_are_refused_and_nothing_is_stored(
    cluster: Cluster, buffer_stub: buffer_pb2_grpc.BufferServiceStub
) -> None:
    job = buffer_stub.GetStats(bpb.GetStatsRequest(), timeout=10).job
    leased = list(
        buffer_stub.LeasePrompts(
            bpb.LeasePromptsRequest(max_prompts=4, consumer="fuzz", kind=tpb.STREAM_KIND_TRAIN),
            timeout=10,
        ).prompts
    )
    assert len(leased) == 4
    stored_before = _stored_groups(cluster, job)
    accepted_before = _accepted(buffer_stub)
    errors_before = rpc_errors(cluster.metrics("buffer"), "buffer")
    (put,) = [m for m in methods("buffer", bpb.DESCRIPTOR) if m.name == "PutTrajectories"]
    with cluster.channel("buffer") as channel:
        call = RawCaller(channel, put)

        @fuzz_settings(60)
        @given(
            prompt=st.sampled_from(leased[:3]),
            which=st.sampled_from(range(GROUP_SIZE)),
            defect=st.sampled_from(sorted(CORRUPTIONS)).flatmap(
                lambda name: st.tuples(st.just(name), CORRUPTIONS[name][1])
            ),
        )
        def put_corrupted(prompt: tpb.Prompt, which: int, defect: tuple[str, Any]) -> None:
            group = make_group(prompt.prompt_id, prompt.epoch, size=GROUP_SIZE)
            name, value = defect
            CORRUPTIONS[name][0](group, group.trajectories[which], value)
            request = bpb.PutTrajectoriesRequest(
                groups=[group], lease_ids=[prompt.lease_id], consumer="fuzz"
            )
            code = call(request)
            assert code is C.INVALID_ARGUMENT, f"{name}={str(value)[:40]}: {code.name}"

        put_corrupted()
        report("buffer.PutTrajectories:one-defect groups", call.seen)
        stored_after = _stored_groups(cluster, job)
        accepted_after = _accepted(buffer_stub)
        # The control: the same kind of group without a defect is accepted and stored.
        good = make_group(leased[3].prompt_id, leased[3].epoch, size=GROUP_SIZE)
        accepted = buffer_stub.PutTrajectories(
            bpb.PutTrajectoriesRequest(groups=[good], lease_ids=[leased[3].lease_id]), timeout=10
        )
    errors_after = rpc_errors(cluster.metrics("buffer"), "buffer")
    # Nothing was added: the cluster's trainer may meanwhile have taken groups that were
    # waiting (an eval round's, once), so a count may only go down.
    grown = {k: (stored_before[k], v) for k, v in stored_after.items() if v > stored_before[k]}
    assert (grown, accepted_after) == ({}, accepted_before)
    # (The trainer may already have taken and trained the control group: count, not storage.)
    assert [r.status for r in accepted.results] == [bpb.PUT_STATUS_ACCEPTED]
    assert _accepted(buffer_stub) == accepted_before + 1
    assert uncounted(errors_before, errors_after, "PutTrajectories", call.seen) == {}
    cluster.assert_healthy()


HOSTILE_FILES: dict[str, bytes | None] = {
    "not-utf8.jsonl": b'{"question": "\xff\xfe"}\n',
    "not-objects.jsonl": b"[1, 2]\n3\n",
    "empty-prompt.jsonl": b'{"question": ""}\n',
    "number-prompt.jsonl": b'{"question": 7}\n',
    "nan.jsonl": b'{"question": NaN, "answer": Infinity}\n',
    "deep.jsonl": DEEP_JSON.encode() + b"\n",
    "truncated.jsonl": b'{"question": "a',
    "garbage.parquet": os.urandom(512),
    "empty.parquet": b"",
    "directory.jsonl": None,
    "missing-column.jsonl": b'{"other": "x"}\n',
}


def test_dataset_files_with_hostile_content_are_refused_with_invalid_argument(
    cluster: Cluster, buffer_stub: buffer_pb2_grpc.BufferServiceStub, tmp_path: Path
) -> None:
    codes = {}
    for name, content in HOSTILE_FILES.items():
        path = tmp_path / name
        if content is None:
            path.mkdir()
        else:
            path.write_bytes(content)
        request = bpb.LoadDatasetRequest(
            path=str(path),
            name=f"hostile-{path.stem}",
            columns=bpb.ColumnMapping(prompt="question"),
            kind=tpb.STREAM_KIND_TRAIN,
        )
        try:
            buffer_stub.LoadDataset(request, timeout=30)
            codes[name] = C.OK
        except grpc.RpcError as exc:
            codes[name] = exc.code()
    assert {n: c.name for n, c in codes.items() if c is not C.INVALID_ARGUMENT} == {}
    cluster.assert_healthy()


# ---------------------------------------------------------------- reward: bad samples


def _sample(i: int) -> rpb.Sample:
    return rpb.Sample(
        sample_id=f"s{i}",
        prompt="What is 2 plus 2?",
        response="#### 4",
        answer="#### 4",
        response_token_ids=encode_array(np.arange(5, dtype=np.int32)),
        finish_reason=tpb.FINISH_REASON_STOP,
    )


SAMPLE_DEFECTS: dict[str, tuple[Callable[[rpb.Sample, Any], None], st.SearchStrategy[Any]]] = {
    "metadata_json": (
        lambda s, v: setattr(s, "metadata_json", v),
        st.sampled_from(["not json", "[1]", "1", '"x"', "{", DEEP_JSON]),
    ),
    "token_dtype": (
        lambda s, v: setattr(s.response_token_ids, "dtype", v),
        st.sampled_from(["float32", "int128", "bfloat16", "object", "bool"]),
    ),
    "token_bytes": (
        lambda s, v: setattr(s.response_token_ids, "data", s.response_token_ids.data[:v]),
        st.sampled_from([1, 3, 17]),
    ),
    "token_shape": (
        lambda s, v: s.response_token_ids.shape.extend(v),
        st.sampled_from([[-5], [6], [2, 3]]),
    ),
    "finish_reason": (
        lambda s, v: setattr(s, "finish_reason", v),
        st.sampled_from([9, -1, 2**31 - 1]),
    ),
    "verifier": (
        lambda s, v: s.verifiers.append(v),
        st.sampled_from(
            ["nope", "os:system", "builtins:eval", "kuberl.common.plugins:load_plugin"]
        ),
    ),
}


def test_samples_with_one_bad_field_are_refused_and_good_batches_get_finite_rewards(
    cluster: Cluster,
) -> None:
    (score,) = [m for m in methods("reward", rpb.DESCRIPTOR) if m.name == "Score"]
    errors_before = rpc_errors(cluster.metrics("reward"), "reward")
    with cluster.channel("reward") as channel:
        call = RawCaller(channel, score)
        stub = reward_pb2_grpc.RewardServiceStub(channel)

        @fuzz_settings(30)
        @given(
            position=st.integers(0, 2),
            defect=st.sampled_from(sorted(SAMPLE_DEFECTS)).flatmap(
                lambda name: st.tuples(st.just(name), SAMPLE_DEFECTS[name][1])
            ),
        )
        def score_corrupted(position: int, defect: tuple[str, Any]) -> None:
            samples = [_sample(i) for i in range(3)]
            name, value = defect
            SAMPLE_DEFECTS[name][0](samples[position], value)
            code = call(rpb.ScoreRequest(samples=samples))
            assert code is C.INVALID_ARGUMENT, f"{name}={str(value)[:40]}: {code.name}"

        score_corrupted()
        report("reward.Score:one-defect samples", call.seen)

        @fuzz_settings(10)
        @given(response=st.text(max_size=200), answer=st.text(max_size=20))
        def score_any_text(response: str, answer: str) -> None:
            sample = rpb.Sample(sample_id="t", prompt="p", response=response, answer=answer)
            (result,) = stub.Score(rpb.ScoreRequest(samples=[sample]), timeout=30).scores
            assert math.isfinite(result.reward)

        score_any_text()
        good = stub.Score(rpb.ScoreRequest(samples=[_sample(i) for i in range(3)]), timeout=30)
    errors_after = rpc_errors(cluster.metrics("reward"), "reward")
    assert [s.reward for s in good.scores] == [1.0, 1.0, 1.0]
    assert uncounted(errors_before, errors_after, "Score", call.seen) == {}
    cluster.assert_healthy()


# ---------------------------------------------------------------- weight-sync: bad uploads


def _chunks(version: int, payload: bytes, chunk_bytes: int = 64 * 1024) -> list[wpb.SnapshotChunk]:
    import torch

    from kuberl.common.weights.chunks import iter_chunks
    from kuberl.common.weights.manifest import ManifestBuilder

    builder = ManifestBuilder(1024 * 1024)
    builder.add("fuzz.weight", torch.uint8, (len(payload),))
    return list(
        iter_chunks(version, [payload], chunk_bytes=chunk_bytes, manifest_last=builder.build)
    )


UPLOAD_DEFECTS: dict[str, Callable[[list[wpb.SnapshotChunk]], list[wpb.SnapshotChunk]]] = {
    # XOR, not a fixed value: the payload is random, and a byte set to 0 that was 0 (1 in 256
    # runs) changed nothing and was rightly accepted.
    "flipped_byte": lambda c: [
        c[0].__class__(**{**_fields(c[0]), "data": bytes([c[0].data[0] ^ 0xFF]) + c[0].data[1:]}),
        *c[1:],
    ],
    "wrong_crc": lambda c: [c[0].__class__(**{**_fields(c[0]), "crc32c": c[0].crc32c ^ 1}), *c[1:]],
    "missing_chunk": lambda c: [c[0], *c[2:]],
    "repeated_chunk": lambda c: [c[0], c[0], *c[1:]],
    "reordered": lambda c: [c[1], c[0], *c[2:]],
    "negative_offset": lambda c: [c[0].__class__(**{**_fields(c[0]), "offset": -1}), *c[1:]],
    "huge_offset": lambda c: [c[0].__class__(**{**_fields(c[0]), "offset": 2**62}), *c[1:]],
    "wrong_sha256": lambda c: [*c[:-1], c[-1].__class__(**{**_fields(c[-1]), "sha256": "0" * 64})],
    "no_last": lambda c: [*c[:-1], c[-1].__class__(**{**_fields(c[-1]), "last": False})],
    "no_manifest": lambda c: [
        *c[:-1],
        c[-1].__class__(**{k: v for k, v in _fields(c[-1]).items() if k != "manifest"}),
    ],
    "other_version": lambda c: [*c[:-1], c[-1].__class__(**{**_fields(c[-1]), "version": 1})],
    "manifest_too_big": lambda c: [*c[:-1], _grow_manifest(c[-1])],
    "only_manifest": lambda c: [c[-1].__class__(**{**_fields(c[-1]), "data": b"", "offset": 0})],
}


def _fields(chunk: wpb.SnapshotChunk) -> dict[str, Any]:
    return {f.name: v for f, v in chunk.ListFields()}


def _grow_manifest(chunk: wpb.SnapshotChunk) -> wpb.SnapshotChunk:
    out = wpb.SnapshotChunk()
    out.CopyFrom(chunk)
    out.manifest.tensors[0].nbytes += 1
    out.manifest.tensors[0].shape[0] += 1
    out.manifest.total_bytes += 1
    return out


def test_corrupted_snapshot_uploads_are_refused_and_the_version_does_not_move(
    cluster: Cluster,
) -> None:
    with cluster.channel("weight_sync") as channel:
        stub = weight_sync_pb2_grpc.WeightSyncServiceStub(channel)
        start = stub.GetVersion(wpb.GetVersionRequest(), timeout=10).version
        codes = {}
        version = start
        for name, corrupt in UPLOAD_DEFECTS.items():
            status = stub.GetStatus(wpb.GetStatusRequest(), timeout=10)
            version = max(version, status.current_version) + 1
            announced = stub.Publish(
                wpb.PublishRequest(version=version, transports=[wpb.TRANSPORT_SNAPSHOT]),
                timeout=10,
            )
            assert announced.upload_snapshot
            chunks = corrupt(_chunks(version, os.urandom(200 * 1024)))
            try:
                stub.UploadSnapshot(iter(chunks), timeout=30)
                codes[name] = C.OK
            except grpc.RpcError as exc:
                codes[name] = exc.code()
        after = stub.GetVersion(wpb.GetVersionRequest(), timeout=10).version
    refused = {C.INVALID_ARGUMENT, C.FAILED_PRECONDITION}
    assert {n: c for n, c in codes.items() if c not in refused} == {}
    assert not any(c in NEVER for c in codes.values())
    assert after == start
    cluster.assert_healthy()


def test_a_real_publish_after_the_fuzzing_reaches_the_rollout_replica_over_mutual_tls(
    cluster: Cluster,
) -> None:
    """The control of the weight-sync fuzzing, and the trainer -> weight-sync -> rollout path
    over mutual TLS: the tiny model's own tensors, published as the trainer publishes them."""
    from safetensors.torch import load_file

    from kuberl.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
    from kuberl.common import tls
    from kuberl.common.weights import WeightPublisher

    tensors = load_file(str(cluster.folder / "model" / "model.safetensors"))
    with cluster.channel("weight_sync") as channel:
        stub = weight_sync_pb2_grpc.WeightSyncServiceStub(channel)
        status = stub.GetStatus(wpb.GetStatusRequest(), timeout=10)
    tls.configure(cluster.client_tls)
    try:
        publisher = WeightPublisher(cluster.address("weight_sync"), transports=("snapshot",))
        # Above anything the upload fuzzing announced (announced versions also block lower ones).
        version = status.current_version + 1_000_000
        try:
            publisher.publish(version, tensors.items())
        except Exception as exc:  # a fuzzed announcement above it: report what blocked it
            pytest.fail(f"publish of version {version} failed: {exc}")
    finally:
        tls.configure(None)

    def replica_version() -> int:
        with cluster.channel("rollout") as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            return int(stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10).policy_version)

    wait_for(lambda: replica_version() == version, 60, f"the replica to load {version}", cluster)
    cluster.assert_healthy()


# ---------------------------------------------------------------- oversized messages


@pytest.mark.parametrize("service", ["buffer", "reward", "rollout", "trainer", "weight_sync"])
def test_a_message_over_the_limit_is_refused_and_the_service_keeps_serving(
    cluster: Cluster, service: str
) -> None:
    path = {
        "buffer": "/kuberl.buffer.v1.BufferService/GetStats",
        "reward": "/kuberl.reward.v1.RewardService/Score",
        "rollout": "/kuberl.rollout.v1.RolloutService/GetStatus",
        "trainer": "/kuberl.trainer.v1.TrainerService/GetStatus",
        "weight_sync": "/kuberl.weight_sync.v1.WeightSyncService/GetStatus",
    }[service]
    # An unknown field (number 15, length-delimited) one byte over the limit: it parses, so
    # only the size can be the reason for the refusal.
    body = b"\x7a" + _varint(MAX_MESSAGE_BYTES) + b"x" * MAX_MESSAGE_BYTES
    with cluster.channel(service) as channel, pytest.raises(grpc.RpcError) as err:
        channel.unary_unary(path)(body, timeout=30)
    assert err.value.code() is C.RESOURCE_EXHAUSTED
    cluster.assert_healthy()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)
