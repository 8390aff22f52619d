"""Protobuf wire encoding for messages that carry large repeated entries (groups of trajectories).

The buffer uses it in its client stub (`kuberl.common.buffer_client`), its GetBatch responses
and its request validation: `serialize_split` encodes a message's head and then each entry of one
repeated field on its own (why: its docstring), `encode_entries` frames entries that are already
bytes (stored groups, sent as they are), and `read_varint` finds the entries of a request
without parsing it again.
"""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf.message import Message

LENGTH_DELIMITED = 2  # the wire type of bytes, strings and embedded messages


def encode_varint(n: int) -> bytes:
    """n >= 0 as a protobuf varint."""
    if n < 0:
        raise ValueError(f"a varint here encodes a size or tag, >= 0; got {n}")
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def read_varint(data: bytes | memoryview, i: int) -> tuple[int, int]:
    """The varint at data[i:] and the index after it (IndexError past the end)."""
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def encode_entries(
    head: bytes | memoryview, field_number: int, entries: Iterable[bytes | memoryview]
) -> bytes:
    """`head` (a serialized message) followed by each entry as one more element of its repeated
    field `field_number`: the serialized message with those entries appended, in one copy."""
    tag = encode_varint(field_number << 3 | LENGTH_DELIMITED)
    parts: list[bytes | memoryview] = [head]
    for entry in entries:
        parts += [tag, encode_varint(len(entry)), entry]
    return b"".join(parts)


def encode_messages(head: Message, field_number: int, entries: Iterable[Message]) -> bytes:
    """`head` serialized with `entries` appended to its repeated message field `field_number`,
    each entry serialized on its own."""
    serialized = (entry.SerializeToString() for entry in entries)
    return encode_entries(head.SerializeToString(), field_number, serialized)


def serialize_split(message: Message, field: str) -> bytes:
    """`message.SerializeToString()` with the repeated message field `field` serialized one entry
    at a time. upb's one-shot encoder grows its buffer by doubling, and past glibc's mmap
    threshold each growth is fresh memory whose pages fault in (figures in docs/buffer.md).
    Parsers accept fields in any order and keep a repeated field's entries in order, so this
    parses to the same message; the bytes differ only in where that field's entries sit."""
    descriptor = message.DESCRIPTOR.fields_by_name.get(field)
    if descriptor is None or not descriptor.is_repeated or descriptor.message_type is None:
        raise ValueError(f"{message.DESCRIPTOR.full_name}.{field} is not a repeated message field")
    head = type(message)()
    for fd, value in message.ListFields():
        if fd.name == field:
            continue
        if fd.is_repeated or fd.message_type is not None:
            getattr(head, fd.name).MergeFrom(value)  # lists, maps and messages
        else:
            setattr(head, fd.name, value)
    return encode_messages(head, descriptor.number, getattr(message, field))
