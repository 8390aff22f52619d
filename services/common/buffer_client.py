"""The buffer's client stub, in `kuberl.common` because other services call the buffer with it.

`BufferStub` is the generated stub whose `PutTrajectories` serializes each group on its own
(`kuberl.common.wire.serialize_split`) or sends bytes made by `encode_put` as they are, since one
`SerializeToString` of a large request costs an order of magnitude more (docs/buffer.md). The
server sees the same message either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.api.buffer.v1 import buffer_pb2_grpc
from kuberl.api.common.v1 import trajectory_pb2 as tpb
from kuberl.common.wire import encode_messages, serialize_split

_SERVICE = bpb.DESCRIPTOR.services_by_name["BufferService"]
PUT_METHOD = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['PutTrajectories'].name}"


def encode_put(head: bpb.PutTrajectoriesRequest, groups: Iterable[tpb.Group]) -> bytes:
    """A serialized PutTrajectoriesRequest: `head` (consumer, kind, lease_ids; no groups) with
    `groups` added, each serialized on its own."""
    if head.groups:
        raise ValueError("head already has groups: pass them as `groups`")
    return encode_messages(head, bpb.PutTrajectoriesRequest.GROUPS_FIELD_NUMBER, groups)


def serialize_put(request: bpb.PutTrajectoriesRequest | bytes) -> bytes:
    """The request serializer of PutTrajectories: bytes as they are, a message split by group."""
    if isinstance(request, bytes | bytearray | memoryview):
        return bytes(request)
    return serialize_split(request, "groups")


class BufferStub(buffer_pb2_grpc.BufferServiceStub):
    """`BufferServiceStub` whose PutTrajectories encodes requests group by group (see above);
    for a sync or an asyncio channel alike."""

    def __init__(self, channel: Any) -> None:
        super().__init__(channel)
        self.PutTrajectories = channel.unary_unary(
            PUT_METHOD,
            request_serializer=serialize_put,
            response_deserializer=bpb.PutTrajectoriesResponse.FromString,
            _registered_method=True,  # as the generated stub registers its methods
        )
