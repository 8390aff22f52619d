"""Live progress of a local run: what the services report, turned into one screen or plain lines.

The supervisor calls `StatsPoller.poll()` about once a second. It asks every service over its
public API, the same one operators use on Kubernetes: the trainer's `GetStatus`, the buffer's
`GetStats`, each rollout replica's `GetStatus`, weight-sync's `GetStatus`, plus weight-sync's
Prometheus `/metrics` for update latencies (histogram sums and counts). `MetricsTail` reads the
trainer's per-step JSONL as it grows. `Progress` keeps the history needed for rates (generated
and trained tokens per second) and an ETA, and renders either a `rich` panel (stdout is a
terminal) or one plain line every `plain_every` seconds (a log, CI).
"""

from __future__ import annotations

import json
import math
import sys
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc

from kuberl.common.channels import sync_channel
from kuberl.common.logs import get_logger

log = get_logger(__name__)

RPC_TIMEOUT = 2.0


@dataclass
class Snapshot:
    """Everything the services said at one moment (None / empty where a call failed)."""

    time: float
    trainer: dict[str, Any] | None = None
    buffer: dict[str, Any] | None = None
    replicas: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    weight_sync: dict[str, Any] | None = None
    # weight-sync histograms: {"publish": (sum, count), "engine_update": (sum, count)}
    sync_seconds: dict[str, tuple[float, float]] = field(default_factory=dict)


def _histogram_totals(text: str, name: str) -> tuple[float, float]:
    """Sum and count of a Prometheus histogram over all its label sets."""
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


class StatsPoller:
    """Asks the services of a run for their status; every address may change (restarts)."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.Channel] = {}

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = sync_channel(address)
        return self._channels[address]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def trainer(self, address: str) -> dict[str, Any] | None:
        from kuberl.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc

        stub = trainer_pb2_grpc.TrainerServiceStub(self._channel(address))
        try:
            r = stub.GetStatus(trainer_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT)
        except grpc.RpcError:
            return None
        return {
            "mode": r.mode,
            "step": r.step,
            "total_steps": r.total_steps,
            "policy_version": r.policy_version,
            "metrics": dict(r.metrics),
            "finished": r.finished,
            "last_checkpoint": r.last_checkpoint,
        }

    def buffer(self, address: str) -> dict[str, Any] | None:
        from kuberl.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc

        stub = buffer_pb2_grpc.BufferServiceStub(self._channel(address))
        try:
            r = stub.GetStats(buffer_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT)
        except grpc.RpcError:
            return None
        return {
            "policy_version": r.policy_version,
            "epoch": r.epoch,
            "cursor": r.cursor,
            "prompts_total": r.prompts_total,
            "prompts_leased": r.prompts_leased,
            "groups_pending": r.groups_pending,
            "batches_unacked": r.batches_unacked,
            "counters": dict(r.counters),
        }

    def replica(self, address: str) -> dict[str, Any] | None:
        from kuberl.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc

        stub = rollout_pb2_grpc.RolloutServiceStub(self._channel(address))
        try:
            r = stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT)
        except grpc.RpcError:
            return None
        return {
            "replica_id": r.replica_id,
            "state": rollout_pb2.ReplicaState.Name(r.state).removeprefix("REPLICA_STATE_"),
            "policy_version": r.policy_version,
            "prompts_in_flight": r.prompts_in_flight,
            "groups_put": r.groups_put,
            "generated_tokens": r.generated_tokens,
        }

    def weight_sync(self, address: str) -> dict[str, Any] | None:
        from kuberl.api.weight_sync.v1 import weight_sync_pb2, weight_sync_pb2_grpc

        stub = weight_sync_pb2_grpc.WeightSyncServiceStub(self._channel(address))
        try:
            r = stub.GetStatus(weight_sync_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT)
        except grpc.RpcError:
            return None
        return {
            "current_version": r.current_version,
            "engines": {e.engine_id: e.loaded_version for e in r.engines},
        }

    @staticmethod
    def sync_seconds(metrics_port: int) -> dict[str, tuple[float, float]]:
        if not metrics_port:
            return {}
        try:
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=RPC_TIMEOUT) as resp:
                text = resp.read().decode()
        except OSError:
            return {}
        return {
            "publish": _histogram_totals(text, "kuberl_weight_sync_publish_seconds"),
            "engine_update": _histogram_totals(text, "kuberl_weight_sync_engine_update_seconds"),
        }


class MetricsTail:
    """New rows of a JSONL file that another process appends to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = ""

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open() as f:
                f.seek(self._offset)
                data = f.read()
                self._offset = f.tell()
        except OSError:
            return []
        text = self._partial + data
        lines = text.split("\n")
        self._partial = lines.pop()  # an incomplete last line waits for the next read
        rows = []
        for line in lines:
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    log.warning("metrics.bad_line", path=str(self.path), line=line[:200])
        return rows


def _fmt_seconds(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _fmt_rate(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    return f"{value:.0f}"


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


@dataclass
class View:
    """The figures shown on screen, derived from snapshots and metric rows."""

    phase: str = "starting"
    step: int = 0
    total: int = 0
    eta_seconds: float | None = None
    reward_mean: float | None = None
    accuracy: float | None = None
    eval_accuracy: float | None = None
    eval_step: int | None = None
    loss: float | None = None
    generated_tps: float | None = None
    trained_tps: float | None = None
    groups_pending: int | None = None
    prompts_leased: int | None = None
    staleness: float | None = None
    trainer_version: int | None = None
    buffer_version: int | None = None
    replica_versions: dict[str, int | None] = field(default_factory=dict)
    weight_sync_version: int | None = None
    publish_ms: float | None = None
    engine_update_ms: float | None = None
    services: dict[str, str] = field(default_factory=dict)
    restarts: int = 0


class Progress:
    """Keeps the run's history and renders it (rich when stdout is a terminal, else lines)."""

    def __init__(
        self,
        title: str,
        *,
        max_staleness: int,
        plain: bool | None = None,
        plain_every: float = 10.0,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.title = title
        self.max_staleness = max_staleness
        self.out = out or sys.stdout
        self.plain = (not self.out.isatty()) if plain is None else plain
        self.plain_every = plain_every
        self.clock = clock
        self.started = clock()
        self.view = View()
        self.timeline: list[dict[str, Any]] = []  # one row per poll, for plots and the summary
        self._gen_hist: deque[tuple[float, float]] = deque(maxlen=30)
        #: Per replica: its last generated-token count and what its earlier lives generated.
        self._gen_counts: dict[str, tuple[int, int]] = {}
        self._sync_hist: deque[tuple[float, dict[str, tuple[float, float]]]] = deque(maxlen=30)
        self._rows: deque[dict[str, Any]] = deque(maxlen=20)  # recent step rows (time, tokens)
        self._last_line = -math.inf
        self._live: Any = None

    # -- feeding ---------------------------------------------------------------------------------

    def set_phase(self, phase: str, total: int = 0) -> None:
        v = self.view
        v.phase = phase
        v.total = total or v.total
        v.step = 0
        v.eta_seconds = v.trained_tps = v.loss = None
        self._rows.clear()

    def set_services(self, services: dict[str, str], restarts: int) -> None:
        self.view.services = services
        self.view.restarts = restarts

    def add_rows(self, rows: list[dict[str, Any]]) -> None:
        """Rows of the trainer's metrics JSONL (kind: sft, rl or eval)."""
        v = self.view
        for row in rows:
            kind = row.get("kind")
            if kind == "eval":
                v.eval_accuracy = row.get("eval/accuracy")
                v.eval_step = v.step
                continue
            self._rows.append(row)
            v.step = int(row.get("step", v.step) or 0)
            v.total = int(row.get("total_steps", v.total) or v.total)
            if kind == "sft":
                v.loss = row.get("loss/sft")
                # An inline warm start (rl mode) keeps step 0; its version counts the sft steps.
                v.step = int(row.get("step") or row.get("policy_version") or 0)
            else:
                v.reward_mean = row.get("reward/mean", v.reward_mean)
                v.accuracy = row.get("reward/accuracy", v.accuracy)
                v.staleness = row.get("batch/staleness_max", v.staleness)
                v.loss = row.get("loss/total", v.loss)
            v.trainer_version = row.get("policy_version", v.trainer_version)
        if len(self._rows) >= 2:
            first, last = self._rows[0], self._rows[-1]
            span = float(last["time"]) - float(first["time"])
            if span > 0:
                steps = len(self._rows) - 1
                v.trained_tps = sum(float(r.get("tokens") or 0) for r in list(self._rows)[1:]) / (
                    span
                )
                left = max(0, v.total - v.step)
                v.eta_seconds = left * span / steps

    def _generated(self, snap: Snapshot) -> int:
        """Tokens generated by every replica so far, across their restarts: a replica's counter
        starts again at 0 in each life, and one that is down answers nothing, so a plain sum
        would fall at every replica restart."""
        for name, status in snap.replicas.items():
            last, before = self._gen_counts.get(name, (0, 0))
            if status:
                now = int(status["generated_tokens"])
                if now < last:  # a new life
                    before += last
                self._gen_counts[name] = (now, before)
        return sum(last + before for last, before in self._gen_counts.values())

    def add_snapshot(self, snap: Snapshot) -> None:
        v = self.view
        if snap.trainer:
            v.trainer_version = snap.trainer["policy_version"]
        if snap.buffer:
            v.groups_pending = snap.buffer["groups_pending"]
            v.prompts_leased = snap.buffer["prompts_leased"]
            v.buffer_version = snap.buffer["policy_version"]
        for name, status in snap.replicas.items():
            v.replica_versions[name] = status["policy_version"] if status else None
        if snap.weight_sync:
            v.weight_sync_version = snap.weight_sync["current_version"]
        generated = self._generated(snap)
        if snap.replicas and all(snap.replicas.values()):
            self._gen_hist.append((snap.time, float(generated)))
        if len(self._gen_hist) >= 2:
            (t0, g0), (t1, g1) = self._gen_hist[0], self._gen_hist[-1]
            if t1 > t0 and g1 >= g0:
                v.generated_tps = (g1 - g0) / (t1 - t0)
        if snap.sync_seconds:
            self._sync_hist.append((snap.time, snap.sync_seconds))
            v.publish_ms = self._window_mean_ms("publish")
            v.engine_update_ms = self._window_mean_ms("engine_update")
        self.timeline.append(
            {
                "time": snap.time,
                "phase": v.phase,
                "step": v.step,
                "generated_tokens": generated if snap.replicas else None,
                "generated_tps": v.generated_tps,
                "trained_tps": v.trained_tps,
                "groups_pending": v.groups_pending,
                "replica_versions": dict(v.replica_versions),
                "trainer_version": v.trainer_version,
                "publish_ms": v.publish_ms,
                "engine_update_ms": v.engine_update_ms,
            }
        )

    def _window_mean_ms(self, key: str) -> float | None:
        """Mean of a histogram over the recent window (whole history until it has two points)."""
        first, last = self._sync_hist[0][1].get(key), self._sync_hist[-1][1].get(key)
        if not last or not last[1]:
            return None
        if first and last[1] > first[1]:
            return 1000 * (last[0] - first[0]) / (last[1] - first[1])
        return 1000 * last[0] / last[1]

    # -- rendering -------------------------------------------------------------------------------

    def line(self) -> str:
        """The plain one-line summary."""
        v = self.view
        elapsed = _fmt_seconds(self.clock() - self.started)
        parts = [f"[{elapsed}] {v.phase}"]
        if v.total:
            parts.append(f"step {v.step}/{v.total} eta {_fmt_seconds(v.eta_seconds)}")
        if v.phase.startswith("warm"):
            parts.append(f"loss {_fmt(v.loss, 3)}")
        else:
            parts.append(f"reward {_fmt(v.reward_mean)} acc {_fmt(v.accuracy)}")
            parts.append(f"eval {_fmt(v.eval_accuracy)}")
            parts.append(f"tok/s gen {_fmt_rate(v.generated_tps)} train {_fmt_rate(v.trained_tps)}")
            parts.append(f"buffer {_fmt(v.groups_pending)} stale {_fmt(v.staleness, 0)}")
            versions = " ".join(f"{k}=v{_fmt(x)}" for k, x in v.replica_versions.items())
            if versions:
                parts.append(versions)
            parts.append(f"sync {_fmt(v.engine_update_ms, 0)}ms")
        return " | ".join(parts)

    def _renderable(self) -> Any:
        from rich.console import Group as RichGroup
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        v = self.view
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        head = Text(f"{self.title}   elapsed {_fmt_seconds(self.clock() - self.started)}")
        bar = ProgressBar(total=max(v.total, 1), completed=v.step, width=30)
        step = Table.grid(padding=(0, 1))
        step.add_row(
            Text(f"{v.phase}  step {v.step}/{v.total or '?'}"),
            bar,
            Text(f"ETA {_fmt_seconds(v.eta_seconds)}"),
        )
        table.add_row("progress", step)
        if v.phase.startswith("warm"):
            table.add_row("sft loss", _fmt(v.loss, 3))
        else:
            eval_text = "-"
            if v.eval_accuracy is not None:
                eval_text = f"{v.eval_accuracy:.3f} (at step {v.eval_step})"
            table.add_row(
                "reward",
                f"mean {_fmt(v.reward_mean, 3)}   accuracy {_fmt(v.accuracy, 3)}   "
                f"eval accuracy {eval_text}",
            )
            table.add_row(
                "tokens/s",
                f"generated {_fmt_rate(v.generated_tps)}   trained {_fmt_rate(v.trained_tps)}",
            )
            table.add_row(
                "buffer",
                f"{_fmt(v.groups_pending)} groups pending   {_fmt(v.prompts_leased)} prompts "
                f"leased   staleness {_fmt(v.staleness, 0)} (max {self.max_staleness})",
            )
            versions = "   ".join(f"{k} v{_fmt(x)}" for k, x in v.replica_versions.items())
            table.add_row(
                "policy",
                f"trainer v{_fmt(v.trainer_version)}   {versions}   "
                f"weight-sync v{_fmt(v.weight_sync_version)}",
            )
            table.add_row(
                "weight sync",
                f"publish {_fmt(v.publish_ms, 0)} ms   engine update "
                f"{_fmt(v.engine_update_ms, 0)} ms",
            )
        marks = {"serving": "[green]●[/]", "starting": "[yellow]●[/]", "finished": "[blue]✓[/]"}
        services = "  ".join(
            f"{marks.get(state, '[red]●[/]')} {name}" for name, state in v.services.items()
        )
        table.add_row("services", Text.from_markup(f"{services}   restarts {v.restarts}"))
        return RichGroup(head, table)

    def render(self, force: bool = False) -> None:
        if self.plain:
            now = self.clock()
            if force or now - self._last_line >= self.plain_every:
                self._last_line = now
                print(self.line(), file=self.out, flush=True)
            return
        if self._live is None:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(
                self._renderable(),
                console=Console(file=self.out),
                auto_refresh=False,
                transient=False,
            )
            self._live.start()
        self._live.update(self._renderable(), refresh=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.update(self._renderable(), refresh=True)
            self._live.stop()
            self._live = None
        elif self.plain:
            self.render(force=True)

    def message(self, text: str) -> None:
        """A line printed above the live panel (or as is in plain mode)."""
        if self._live is not None:
            self._live.console.print(text)
        else:
            print(text, file=self.out, flush=True)
