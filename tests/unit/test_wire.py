"""Protobuf wire helpers (`kuberl.common.wire`) and the buffer client's request encoding
(`kuberl.common.buffer_client`): a message encoded entry by entry parses to the very message that
`SerializeToString` encodes, whatever its other fields hold."""

from __future__ import annotations

import pytest
from google.protobuf import struct_pb2
from hypothesis import given
from hypothesis import strategies as st

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.buffer.server import encode_batch
from kuberl.buffer.validation import group_slices
from kuberl.common.buffer_client import encode_put, serialize_put
from kuberl.common.wire import encode_entries, encode_varint, read_varint, serialize_split
from tests.integration.buffer_support import make_group


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_a_varint_reads_back_as_written(n: int) -> None:
    data = b"\x01" + encode_varint(n) + b"\x02"
    assert read_varint(data, 1) == (n, len(data) - 1)


def test_varints_match_protobufs_own_encoding() -> None:
    # A string field of length n is its tag (consumer: field 2, 0x12), varint(n), the bytes;
    # proto3 leaves an empty one out.
    for n in (1, 127, 128, 300, 16_384, 2**21):
        blob = b"x" * n
        encoded = bpb.PutTrajectoriesRequest(consumer=blob.decode()).SerializeToString()
        assert encoded == b"\x12" + encode_varint(n) + blob


def test_a_negative_varint_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        encode_varint(-1)


def test_reading_past_the_end_raises_index_error() -> None:
    with pytest.raises(IndexError):
        read_varint(b"\x80\x80", 0)


def _put_request(n: int) -> bpb.PutTrajectoriesRequest:
    return bpb.PutTrajectoriesRequest(
        groups=[make_group(f"train:{i}") for i in range(n)],
        consumer="rollout-0",
        kind=1,
        lease_ids=[f"{i}-0" for i in range(n)],
    )


@pytest.mark.parametrize("n", [0, 1, 8])
def test_a_put_split_by_group_parses_to_the_same_request(n: int) -> None:
    request = _put_request(n)
    assert bpb.PutTrajectoriesRequest.FromString(serialize_put(request)) == request


def test_a_split_put_keeps_the_groups_readable_in_place() -> None:
    # The buffer stores each group's bytes straight from the request (group_slices).
    request = _put_request(3)
    slices = group_slices(serialize_put(request), 3)
    assert slices is not None
    assert [bytes(s) for s in slices] == [g.SerializeToString() for g in request.groups]


def test_encode_put_equals_splitting_the_whole_request() -> None:
    request = _put_request(4)
    head = bpb.PutTrajectoriesRequest(
        consumer=request.consumer, kind=request.kind, lease_ids=request.lease_ids
    )
    assert encode_put(head, request.groups) == serialize_put(request)


def test_encode_put_refuses_a_head_that_already_holds_groups() -> None:
    with pytest.raises(ValueError, match="already has groups"):
        encode_put(_put_request(1), [])


def test_bytes_are_sent_as_they_are() -> None:
    data = _put_request(2).SerializeToString()
    assert serialize_put(data) is data


def test_other_fields_of_every_kind_survive_the_split() -> None:
    # Struct's `fields` is a map of messages; ListValue's `values` the repeated field split.
    value = struct_pb2.Value(
        struct_value=struct_pb2.Struct(fields={"a": struct_pb2.Value(number_value=1.5)})
    )
    listed = struct_pb2.ListValue(values=[value, struct_pb2.Value(string_value="x"), value])
    assert struct_pb2.ListValue.FromString(serialize_split(listed, "values")) == listed
    batch = bpb.GetBatchResponse(
        batch_id="b-1",
        groups=[make_group("train:0"), make_group("train:1")],
        dropped={"stale": 2, "zero_variance": 1},
        redelivered=True,
    )
    assert bpb.GetBatchResponse.FromString(serialize_split(batch, "groups")) == batch


@pytest.mark.parametrize("field", ["consumer", "lease_ids", "kind", "missing"])
def test_only_a_repeated_message_field_can_be_split(field: str) -> None:
    with pytest.raises(ValueError, match="not a repeated message field"):
        serialize_split(_put_request(1), field)


def test_entries_appended_to_a_head_are_that_field_in_order() -> None:
    groups = [make_group(f"train:{i}") for i in range(3)]
    head = bpb.GetBatchResponse(batch_id="b-2", redelivered=True)
    data = encode_entries(head.SerializeToString(), 2, [g.SerializeToString() for g in groups])
    assert bpb.GetBatchResponse.FromString(data) == bpb.GetBatchResponse(
        batch_id="b-2", groups=groups, redelivered=True
    )
    assert encode_batch(head, [g.SerializeToString() for g in groups]) == data
