"""Peer relay of snapshot downloads: engines that hold the current version pass it on.

Without it the service streams every snapshot itself, a star: N engines cost N x the model's
bytes out of one pod, and a version reaches the last engine after N x size / the pod's bandwidth.
With `weight_sync.relay_fanout` = k > 0, each source (the service, and every engine that holds the
version and serves it, `EngineInfo.peer_endpoint`) streams to at most k engines at a time; an
engine that would exceed every source's k waits (it is assigned the moment a slot frees, by the
report of the download ahead of it). Sources multiply every round, so the version reaches N
engines in about log_{k+1}(N) transfer times while the pod streams k copies at a time (about
k x log_{k+1}(N) per version) instead of N. Engines
that serve nobody (SGLang loads from disk; `peer_endpoint` empty) never wait: the service streams
to them as before, or a peer with a free slot does. Pure state, driven by the server.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

#: The service itself, as a source.
SERVICE = ""


@dataclass
class _Version:
    version: int
    #: Source engine id (SERVICE for the service) -> engines it streams to now.
    load: dict[str, set[str]] = field(default_factory=lambda: {SERVICE: set()})
    #: Peer sources with a free slot, oldest holder first (so finding one costs O(1)).
    open: OrderedDict[str, None] = field(default_factory=OrderedDict)
    #: Engines waiting for a slot, in order of arrival.
    waiting: OrderedDict[str, None] = field(default_factory=OrderedDict)


class Relay:
    """Chooses the source of each snapshot download of the newest version."""

    def __init__(self, fanout: int) -> None:
        self.fanout = fanout
        self._endpoints: dict[str, str] = {}  # engine id -> its peer endpoint
        self._now: _Version | None = None
        #: Downloading engine -> (the version, its source).
        self._source_of: dict[str, tuple[int, str]] = {}

    def join(self, engine_id: str, peer_endpoint: str) -> None:
        """An engine (re)registered; it may serve peers at `peer_endpoint` ("" = it does not)."""
        self.leave(engine_id)
        if peer_endpoint:
            self._endpoints[engine_id] = peer_endpoint

    def leave(self, engine_id: str) -> None:
        """An engine is gone: it neither waits nor serves (its downloaders fail and retry)."""
        self.finished(engine_id)
        self._endpoints.pop(engine_id, None)
        if self._now is not None:
            self._now.waiting.pop(engine_id, None)
            self._now.load.pop(engine_id, None)
            self._now.open.pop(engine_id, None)

    def source(self, engine_id: str, version: int) -> str | None:
        """Where `engine_id` downloads `version` from: a peer's endpoint, SERVICE, or None (it
        waits for a slot, and is handed out by `admit_waiting`)."""
        if self.fanout <= 0:
            return SERVICE
        now = self._now
        if now is None or version > now.version:
            now = self._now = _Version(version)
        if version < now.version:
            return SERVICE  # an older version is nobody's to relay any more
        # A peer with a free slot first: the service's slots are for the first round.
        if now.open:
            chosen = next(iter(now.open))
        elif len(now.load[SERVICE]) < self.fanout:
            chosen = SERVICE
        elif engine_id not in self._endpoints:
            return SERVICE  # it will serve nobody: it never waits (the star's behaviour)
        else:
            now.waiting[engine_id] = None
            return None
        now.load[chosen].add(engine_id)
        if chosen != SERVICE and len(now.load[chosen]) >= self.fanout:
            now.open.pop(chosen, None)
        now.waiting.pop(engine_id, None)
        self._source_of[engine_id] = (version, chosen)
        return SERVICE if chosen == SERVICE else self._endpoints[chosen]

    def finished(self, engine_id: str) -> str | None:
        """`engine_id`'s download ended (loaded, failed, timed out): its source's slot frees.
        Returns that source (SERVICE, a peer's engine id) or None if it had none."""
        version, source = self._source_of.pop(engine_id, (0, None))
        now = self._now
        # A slot of an older version's tree is gone with it (the same engine may be a source
        # of the newest one, with slots of its own).
        current = now is not None and version == now.version
        if now is not None and current and source is not None and source in now.load:
            now.load[source].discard(engine_id)
            if source != SERVICE:
                now.open[source] = None
        return source

    def holds(self, engine_id: str, version: int) -> None:
        """`engine_id` loaded `version`: it becomes a source of it, if it serves peers."""
        now = self._now
        if now is None or version != now.version or engine_id not in self._endpoints:
            return
        if engine_id not in now.load:
            now.load[engine_id] = set()
            now.open[engine_id] = None

    def failed_source(self, source: str) -> None:
        """A download from peer `source` failed: it gets no more downloaders of this version
        (it may be gone; the service's reaper drops it if so)."""
        if self._now is not None and source != SERVICE:
            self._now.load.pop(source, None)
            self._now.open.pop(source, None)

    def source_of(self, engine_id: str) -> str | None:
        """The source `engine_id` is downloading from now (SERVICE, a peer's id) or None."""
        got = self._source_of.get(engine_id)
        return None if got is None else got[1]

    def waiting_count(self) -> int:
        return len(self._now.waiting) if self._now is not None else 0

    def next_waiting(self) -> str | None:
        """Take the engine that has waited longest off the queue (None if nobody waits); asking
        `source` for it again queues it at the back if no slot is free."""
        if self._now is None or not self._now.waiting:
            return None
        return self._now.waiting.popitem(last=False)[0]

    def is_waiting(self, engine_id: str) -> bool:
        return self._now is not None and engine_id in self._now.waiting
