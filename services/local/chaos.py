"""Fault injection for `kuberl run --chaos <profile>`: SIGKILL services while a job trains.

The supervisor (`kuberl.local.supervisor`) asks a `ChaosMonkey` once a tick whether a fault is
due, kills its target (a service's process group, as an evicted pod dies, or the embedded
redis-server) and recovers it as it would any crash. The monkey holds the seeded plan and
records, per fault, when it fired, when the target was back and whether the trainer completed a
step after that; `kuberl.local.accounting` turns that record into `chaos.json`.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kuberl.common.logs import get_logger

log = get_logger(__name__)

SERVICE_KINDS = ("rollout", "reward", "buffer", "weight-sync", "trainer")
KINDS = (*SERVICE_KINDS, "redis")


@dataclass(frozen=True)
class ChaosProfile:
    """How many faults, and where in the job they may land.

    Args:
        kills_per_kind: SIGKILLs of each service kind (a random replica for `rollout`).
        redis_kills: SIGKILLs of the embedded Redis.
        window: (first, last) fraction of `trainer.total_steps` over which faults are due.
        first_step: no fault before the trainer has completed this many RL steps (so the eval
            round before the faults and the first weight publish are done).
        max_delay_seconds: a fault fires a random 0..this many seconds after its step is seen.
        min_gap_seconds: at least this long between one fault's recovery and the next fault.
    """

    name: str
    kills_per_kind: int
    redis_kills: int
    window: tuple[float, float]
    first_step: int = 2
    max_delay_seconds: float = 3.0
    min_gap_seconds: float = 2.0

    @property
    def faults(self) -> int:
        return self.kills_per_kind * len(SERVICE_KINDS) + self.redis_kills


# `ci`: the CI-sized run (tests/reliability/test_chaos.py): 11 faults in a job of a few minutes.
# `long`: `make chaos`, 31 faults over 10+ minutes.
PROFILES = {
    # The window ends well before the job does: a killed rollout replica needs tens of seconds
    # to come back on a small machine, and the last fault needs steps after its recovery to be
    # survived. The short delay and gap fit 11 faults into a job of a few minutes.
    "ci": ChaosProfile(
        "ci",
        kills_per_kind=2,
        redis_kills=1,
        window=(0.05, 0.6),
        max_delay_seconds=1.0,
        min_gap_seconds=1.0,
    ),
    "long": ChaosProfile(
        "long",
        kills_per_kind=6,
        redis_kills=1,
        window=(0.05, 0.85),
        max_delay_seconds=10.0,
        min_gap_seconds=5.0,
    ),
}


def chaos_profile(name: str, *, external_redis: bool) -> ChaosProfile:
    """The named profile; without Redis faults when the job's Redis is not the embedded one: it
    is not ours to kill or restart, so a Redis fault would never recover and block the rest."""
    profile = PROFILES[name]
    return replace(profile, redis_kills=0) if external_redis else profile


@dataclass
class Fault:
    """One planned fault and what happened to it."""

    index: int
    kind: str
    due_step: int
    delay_seconds: float
    target: str = ""  # process name (`rollout-1`, `trainer`, ...) or `redis`
    pid: int | None = None
    fired_unix: float | None = None
    fired_at_step: int | None = None
    starts_before: int = 0  # the target's start count when it was killed
    recovered_unix: float | None = None
    steps_at_recovery: int | None = None  # RL steps completed (rows seen) when it recovered
    survived: bool = False  # back up and the trainer completed an RL step afterwards
    # internal: when the due step was first seen
    _seen_unix: float | None = field(default=None, repr=False)

    def record(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("_seen_unix", None)
        out.pop("starts_before", None)
        if self.fired_unix is not None and self.recovered_unix is not None:
            out["recovery_seconds"] = round(self.recovered_unix - self.fired_unix, 2)
        return out


class ChaosMonkey:
    """The seeded fault plan of one run and its record (driven by the supervisor's ticks).

    From the seed: a shuffled list of fault kinds, each due at an RL step drawn uniformly over
    the profile's window and a random delay after that step is seen, so kills land anywhere in
    a step (mid-generation, mid-optimizer-step, mid-checkpoint, mid-publish); the replica a
    `rollout` fault kills. A fault fires only when every service is up and `min_gap_seconds`
    after the last recovery, except past the window's end, where each fires as soon as all is up.
    """

    def __init__(
        self, profile: ChaosProfile, seed: int, total_steps: int, replicas: list[str]
    ) -> None:
        if not replicas:
            raise ValueError("chaos needs at least one rollout replica")
        self.profile = profile
        self.seed = seed
        self.rng = random.Random(seed)
        kinds = [k for k in SERVICE_KINDS for _ in range(profile.kills_per_kind)]
        kinds += ["redis"] * profile.redis_kills
        self.rng.shuffle(kinds)
        lo = max(profile.first_step, int(total_steps * profile.window[0]))
        hi = max(lo, int(total_steps * profile.window[1]))
        steps = sorted(self.rng.randint(lo, hi) for _ in kinds)
        self.window_end_step = hi
        self.faults = [
            Fault(
                index=i,
                kind=kind,
                due_step=step,
                delay_seconds=round(self.rng.uniform(0, profile.max_delay_seconds), 2),
                target=self.rng.choice(replicas) if kind == "rollout" else kind,
            )
            for i, (kind, step) in enumerate(zip(kinds, steps, strict=True))
        ]
        self._next = 0
        self._last_recovery = 0.0
        log.info(
            "chaos.plan",
            profile=profile.name,
            seed=seed,
            faults=[(f.kind, f.target, f.due_step) for f in self.faults],
        )

    @property
    def pending(self) -> Fault | None:
        """The next fault to fire (None when all have fired)."""
        return self.faults[self._next] if self._next < len(self.faults) else None

    @property
    def in_flight(self) -> Fault | None:
        """The last fault fired, while it has not recovered yet."""
        if self._next == 0:
            return None
        last = self.faults[self._next - 1]
        return last if last.recovered_unix is None else None

    def due(self, step: int, now: float, all_up: bool) -> Fault | None:
        """The fault to fire now, if any (the caller kills its target and calls `fired`)."""
        fault = self.pending
        if fault is None or self.in_flight is not None or not all_up:
            return None
        if step < fault.due_step:
            return None
        if step > self.window_end_step:
            # Behind the plan (slow recoveries on a loaded machine): fire at once, without the
            # gap and the delay, so every fault lands while the job still has steps to survive it.
            return fault
        if now - self._last_recovery < self.profile.min_gap_seconds:
            return None
        if fault._seen_unix is None:
            fault._seen_unix = now
        if now - fault._seen_unix < fault.delay_seconds:
            return None
        return fault

    def fired(self, fault: Fault, pid: int | None, starts: int, step: int, now: float) -> None:
        fault.pid, fault.starts_before = pid, starts
        fault.fired_unix, fault.fired_at_step = now, step
        self._next += 1
        log.warning(
            "chaos.kill",
            index=fault.index,
            kind=fault.kind,
            target=fault.target,
            pid=pid,
            step=step,
        )

    def check_recovery(
        self, starts: dict[str, int], up: dict[str, bool], steps_done: int, now: float
    ) -> None:
        """Note recoveries (the target restarted and is up) and survivals (a step since)."""
        now_fault = self.in_flight
        if now_fault is not None:
            t = now_fault.target
            if up.get(t) and starts.get(t, 0) > now_fault.starts_before:
                now_fault.recovered_unix = now
                now_fault.steps_at_recovery = steps_done
                self._last_recovery = now_fault.recovered_unix
                log.warning("chaos.recovered", index=now_fault.index, target=t)
        for fault in self.faults[: self._next]:
            if (
                not fault.survived
                and fault.steps_at_recovery is not None
                and steps_done > fault.steps_at_recovery
            ):
                fault.survived = True

    def record(self) -> dict[str, Any]:
        fired = [f for f in self.faults if f.fired_unix is not None]
        return {
            "profile": asdict(self.profile),
            "seed": self.seed,
            "faults_planned": len(self.faults),
            "faults_injected": {k: sum(f.kind == k for f in fired) for k in KINDS},
            "faults_survived": sum(f.survived for f in fired),
            "faults_survived_by_kind": {
                k: sum(f.kind == k and f.survived for f in fired) for k in KINDS
            },
            "faults": [f.record() for f in self.faults],
        }
