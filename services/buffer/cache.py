"""The group bytes this replica stored, kept in memory until it hands them out.

Every accepted group is written to Redis (that is what makes it durable and visible to every
replica) and read back from Redis when a batch takes it. When the replica that accepted the put
is also the one that assembles the batch (always with one replica), the read-back moves the same
bytes out of Redis again: ~5 MB per batch of 32 groups of 8 x 2,048 tokens. This cache keeps each
accepted payload under its field in the payloads hash until a batch of this replica takes it, so
that batch reads only what the cache lacks.

It is only ever a copy: a payload's field is a fresh random key per put attempt and its bytes
never change, so a hit is exactly what Redis holds (the field and the stream entry are written in
one MULTI/EXEC, so Redis never has the entry without the bytes either). A miss (another replica
accepted the group, the entry was evicted, a batch is re-delivered, the replica restarted) reads
Redis as before. Entries leave when a batch takes them, when they are dropped, or, oldest first,
when the cache holds more than `max_bytes` (`buffer.payload_cache_mib`; 0 turns it off). An entry
another replica handed out stays until it is evicted that way: harmless, its key is never used
again.
"""

from __future__ import annotations

from kuberl.buffer import metrics as m

Payload = bytes | memoryview


class PayloadCache:
    """Payloads by their field in the payloads hash, oldest evicted first beyond max_bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, max_bytes)
        self._items: dict[str, Payload] = {}  # insertion order = age
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, key: str, payload: Payload) -> None:
        """Keep payload under key (a payload larger than the whole cache is not kept)."""
        size = len(payload)
        if not key or size == 0 or size > self.max_bytes:
            return
        self._pop(key)
        self._items[key] = payload
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            self._pop(next(iter(self._items)))
            m.PAYLOAD_CACHE_TOTAL.labels("evicted").inc()
        m.PAYLOAD_CACHE_BYTES.set(self.nbytes)

    def take(self, key: str) -> Payload | None:
        """The payload under key, removed from the cache; None (a miss) if it is not here."""
        payload = self._pop(key)
        m.PAYLOAD_CACHE_TOTAL.labels("miss" if payload is None else "hit").inc()
        return payload

    def discard(self, key: str) -> None:
        """Forget key (a dropped group, whose bytes Redis deletes too)."""
        self._pop(key)

    def _pop(self, key: str) -> Payload | None:
        payload = self._items.pop(key, None)
        if payload is not None:
            self.nbytes -= len(payload)
            m.PAYLOAD_CACHE_BYTES.set(self.nbytes)
        return payload
