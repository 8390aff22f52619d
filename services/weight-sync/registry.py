"""The pool of rollout engines the weight-sync service knows: who they are, what they hold, and
the update each is receiving. Pure state with an injectable clock (the server drives it from its
event loop; tests drive it by hand). An engine is alive while it heartbeats or holds a long poll
open; one silent for `heartbeat_seconds * missed_heartbeats` is expired.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb


@dataclass
class Assignment:
    """The update an engine is receiving: its instruction, when it was given, its deadline."""

    instruction: pb.UpdateInstruction
    started: float
    deadline: float
    #: The relay's sender for broadcast transports (closed when the assignment ends).
    sender: Any = None

    @property
    def version(self) -> int:
        return int(self.instruction.version)

    @property
    def transport(self) -> int:
        return int(self.instruction.transport)


@dataclass
class Engine:
    engine_id: str
    endpoint: str
    transports: list[Any]
    device: str
    host: str
    ranks: int
    loaded_version: int
    last_seen: float
    registered_at: float
    polls: int = 0
    assignment: Assignment | None = None
    last_transport: int = 0
    last_error: str = ""
    #: Versions this engine must not get by broadcast (it joined after their fan-out began).
    catch_up_below: int = 0
    wake: Any = field(default=None, repr=False)
    gpu_uuid: str = ""
    #: Serves from the shared-memory file itself: the one it holds stays pinned.
    shm_in_place: bool = False
    #: Shared-memory versions sent to it and not yet reported (their segments stay unreused).
    pins: list[Any] = field(default_factory=list, repr=False)
    #: The update it was timed out of and has not reported on since: it is most likely still
    #: receiving it (a slow engine), so it is sent nothing of that version again, and later
    #: versions by snapshot, until it reports or heartbeats a version at least as new.
    overdue: Assignment | None = field(default=None, repr=False)
    #: Updates that failed in a row, and when the next catch-up may be sent: a version this
    #: engine cannot load is retried with a growing pause, not as fast as it fails.
    failures: int = 0
    retry_at: float = 0.0

    def info(self, now: float) -> pb.EngineInfo:
        return pb.EngineInfo(
            engine_id=self.engine_id,
            endpoint=self.endpoint,
            transports=self.transports,
            device=self.device,
            host=self.host,
            loaded_version=self.loaded_version,
            last_seen_seconds=0.0 if self.polls else max(0.0, now - self.last_seen),
            ranks=self.ranks,
            last_transport=self.last_transport,  # type: ignore[arg-type]
            last_error=self.last_error,
            gpu_uuid=self.gpu_uuid,
            shm_in_place=self.shm_in_place,
        )


class Registry:
    """Engines by id, with liveness by heartbeat."""

    def __init__(
        self,
        heartbeat_seconds: float,
        missed_heartbeats: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.heartbeat_seconds = heartbeat_seconds
        self.missed_heartbeats = missed_heartbeats
        self.clock = clock
        self.engines: dict[str, Engine] = {}

    @property
    def silence_limit(self) -> float:
        return self.heartbeat_seconds * self.missed_heartbeats

    def register(self, info: pb.EngineInfo) -> tuple[Engine, bool]:
        """Add (or, for a known id, replace) an engine; returns it and whether it is new."""
        now = self.clock()
        engine_id = info.engine_id or f"engine-{uuid.uuid4().hex[:12]}"
        previous = self.engines.get(engine_id)
        engine = Engine(
            engine_id=engine_id,
            endpoint=info.endpoint,
            transports=list(info.transports) or [pb.TRANSPORT_SNAPSHOT],
            device=info.device or "cpu",
            host=info.host,
            ranks=max(1, info.ranks),
            loaded_version=max(0, info.loaded_version),
            last_seen=now,
            registered_at=now,
            gpu_uuid=info.gpu_uuid,
            shm_in_place=info.shm_in_place,
        )
        if previous is not None:
            engine.wake = previous.wake
            engine.pins = previous.pins  # still unreported: keep them pinned
        self.engines[engine_id] = engine
        return engine, previous is None

    def get(self, engine_id: str) -> Engine | None:
        return self.engines.get(engine_id)

    def touch(self, engine: Engine) -> None:
        engine.last_seen = self.clock()

    def remove(self, engine_id: str) -> Engine | None:
        return self.engines.pop(engine_id, None)

    def expired(self) -> list[Engine]:
        """Engines silent for longer than the limit (none while a long poll is open)."""
        now = self.clock()
        return [
            e
            for e in self.engines.values()
            if not e.polls and now - e.last_seen > self.silence_limit
        ]

    def engines_per_version(self) -> dict[int, int]:
        return dict(Counter(e.loaded_version for e in self.engines.values()))
