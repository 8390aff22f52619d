"""The buffer's gRPC service (`kuberl serve buffer`): the hub between rollout and trainer.

Rollout replicas lease prompts (`LeasePrompts`), put finished groups (`PutTrajectories`) and give
back what they cannot finish (`ReleasePrompts`); the trainer pulls whole groups (`GetBatch`),
acknowledges each batch after its optimizer step (`Ack`) and advances the policy version
(`SetPolicyVersion`). This module validates requests, applies the batch filters (staleness, DAPO
dynamic sampling, custom `module:function` filters) and maps results to protos and status codes;
all state is in Redis through `kuberl.buffer.store`, so replicas are interchangeable. At start the
service connects to `redis.url`, creates the job's streams and loads `data.train` and `data.eval`
(idempotently), so no one else has to call LoadDataset. docs/buffer.md is the user guide.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.api.common.v1 import trajectory_pb2 as tpb
from kuberl.buffer import metrics as m
from kuberl.buffer.allocator import keep_freed_memory
from kuberl.buffer.store import DATASET_NAME, BufferStore, Drop, PutItem, StoredGroup, lease_kind
from kuberl.buffer.validation import RawPutRequest, check_group, group_payloads, job_limits
from kuberl.common.channels import aio_channel
from kuberl.common.config import DatasetConfig, JobConfig
from kuberl.common.datasets import read_dataset
from kuberl.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from kuberl.common.logs import get_logger
from kuberl.common.plugins import PluginError, load_plugin
from kuberl.common.server import Service
from kuberl.common.trajectory import Group, TrajectoryError
from kuberl.common.wire import encode_entries

log = get_logger(__name__)

SERVICE_NAME = "kuberl.buffer.v1.BufferService"
KIND_NAMES: dict[int, str] = {
    tpb.STREAM_KIND_UNSPECIFIED: "train",
    tpb.STREAM_KIND_TRAIN: "train",
    tpb.STREAM_KIND_EVAL: "eval",
    tpb.STREAM_KIND_SFT: "sft",
}
MAX_LEASE = 4096
#: Bounds of every repeated field and string a request may carry (larger: INVALID_ARGUMENT):
#: groups of one put and lease ids of one release are at most what one lease hands out.
MAX_PUT_GROUPS = MAX_LEASE
MAX_RELEASE_IDS = MAX_LEASE
MAX_BATCH_GROUPS = MAX_LEASE
MAX_NAME_CHARS = 256  # consumer names (pod names are at most 253)
#: The consumers of the trainer group: the trainer's own reads (training, eval rounds). Any
#: other name would take groups away from the trainer.
TRAINER_CONSUMERS = frozenset({"trainer", "trainer-eval"})
MAX_WAIT_SECONDS = 600.0
# A LeasePrompts long poll looks again for room freed through another replica (room freed here
# wakes it at once) after LEASE_POLL_SECONDS, then twice as long each time up to
# LEASE_POLL_MAX_SECONDS: replicas parked on a full window for a whole run otherwise cost a Redis
# script and a wake-up each every 0.1 s.
LEASE_POLL_SECONDS = 0.1
LEASE_POLL_MAX_SECONDS = 1.0
STATS_REFRESH_SECONDS = 2.0
# Redis' Lua scripts compute in doubles: larger versions and rounds would be stored rounded
# (and unreadable as integers afterwards), so they are refused.
MAX_EXACT_INT = 2**53 - 1
#: How long SetPolicyVersion waits for weight-sync's version before it checks only "forward".
VERSION_CHECK_SECONDS = 2.0

GroupFilter = Callable[[Group], Any]


def _kind(value: int) -> str:
    try:
        return KIND_NAMES[value]
    except KeyError:
        raise InvalidArgument(f"unknown stream kind {value}; expected TRAIN, EVAL or SFT") from None


def encode_batch(head: bpb.GetBatchResponse, payloads: Sequence[bytes]) -> bytes:
    """A serialized GetBatchResponse whose groups are the stored Group bytes as they are: they
    are appended without being parsed and encoded again, which was most of the cost of a batch
    in Python (kuberl.common.wire)."""
    return encode_entries(
        head.SerializeToString(), bpb.GetBatchResponse.GROUPS_FIELD_NUMBER, payloads
    )


def _age_verdict(g: StoredGroup, max_staleness: int, current_version: int) -> str | None:
    """Why a training group's policy version rules it out for a trainer at `current_version`
    that bounds staleness (`max_staleness` >= 0; without a bound versions rule nothing out)."""
    if max_staleness < 0:
        return None
    if g.version > current_version:
        return "future_version"  # no engine holds weights the trainer has not made yet
    if current_version - g.version > max_staleness:
        return "stale"
    return None


class Pulse:
    """Wakes every waiter at once; a waiter gives up after its timeout. (The lease long polls
    wait on one for room that this replica frees: acks, drops, releases.)"""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        if timeout > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), timeout)


def _wait_seconds(method: str, value: float) -> float:
    """A request's wait_seconds clamped to [0, MAX_WAIT_SECONDS]; NaN is refused."""
    if math.isnan(value):
        raise _reject(method, "bad_request", InvalidArgument("wait_seconds is NaN"))
    return min(max(value, 0.0), MAX_WAIT_SECONDS)


def _reject(method: str, reason: str, exc: Exception) -> Exception:
    m.REJECTIONS_TOTAL.labels(method, reason).inc()
    return exc


def _bounded(method: str, what: str, size: int, limit: int) -> None:
    """Refuse a repeated field or string longer than its documented bound."""
    if size > limit:
        raise _reject(
            method,
            "too_many",
            InvalidArgument(f"{what} has {size} entries; at most {limit} per request"),
        )


class BufferService(Service):
    """The buffer service of one job (see the module docstring)."""

    name = "buffer"
    service_names = (SERVICE_NAME,)

    def __init__(self, config: JobConfig) -> None:
        self.config = config
        self.cfg = config.buffer
        self.group_size = config.rollout.group_size
        self.limits = job_limits(config)
        self.filters: list[tuple[str, GroupFilter]] = [
            (spec, load_plugin(spec, kind="buffer filter", params=["group"]))
            for spec in self.cfg.filters
        ]
        for spec, fn in self.filters:
            if inspect.iscoroutinefunction(fn):  # its coroutine is truthy: it would keep all
                raise PluginError(f"buffer filter {spec!r}: must be a plain function, not async")
        self.store: BufferStore | None = None
        # Weight-sync bounds the policy version when the job publishes weights (see
        # SetPolicyVersion); opened in start().
        self._weight_sync: Any = None
        self._ws_channel: grpc.aio.Channel | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._room = Pulse()  # this replica freed room in the in-flight window

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def db(self) -> BufferStore:
        # Handlers run only once start() has returned (the bootstrap's start gate).
        assert self.store is not None, "connected by start()"
        return self.store

    async def start(self) -> None:
        self.store = BufferStore.from_config(self.config)
        await self.store.wait_ready(self.config.redis.connect_timeout_seconds)
        await self.store.ensure_groups()
        await self.store.load_scripts()
        for ds in self.config.data.train:
            await self._load_config_dataset(ds, "train", self.config.data.num_epochs)
        for ds in self.config.data.eval:
            await self._load_config_dataset(ds, "eval", 1)
        tc = self.config.trainer
        if tc.publish_weights and tc.mode == "rl":
            from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc

            self._ws_channel = aio_channel(self.config.endpoints.weight_sync)
            self._weight_sync = weight_sync_pb2_grpc.WeightSyncServiceStub(self._ws_channel)
        self._refresher = asyncio.create_task(self._refresh_gauges())
        log.info(
            "buffer.ready", job=self.config.job.name, group_size=self.group_size,
            kinds=sorted(self.limits.kinds), max_sequence_tokens=self.limits.max_tokens,
        )  # fmt: skip
        if not self.limits.max_tokens:
            log.warning("buffer.no_length_bound", model=self.config.model.path)

    async def stop(self) -> None:
        if self._refresher:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        if self._ws_channel is not None:
            await self._ws_channel.close()
        if self.store:
            await self.store.close()

    async def _load_config_dataset(self, ds: DatasetConfig, kind: str, epochs: int) -> None:
        await self._load(
            path=ds.path,
            name=ds.name or "",
            kind=kind,
            prompt=ds.columns.prompt,
            answer=ds.columns.answer,
            metadata=ds.columns.metadata,
            limit=ds.limit,
            num_epochs=epochs,
            seed=self.config.job.seed,
            source={"split": ds.split, "subset": ds.subset, "revision": ds.revision},
        )

    async def _load(
        self,
        *,
        path: str,
        name: str,
        kind: str,
        prompt: str,
        answer: str,
        metadata: Sequence[str],
        limit: int,
        num_epochs: int,
        seed: int,
        source: dict[str, Any] | None = None,
    ) -> tuple[int, bool]:
        name = name or Path(path).stem
        if not DATASET_NAME.match(name):
            raise InvalidArgument(
                f"dataset name {name!r}: use letters, digits, '_', '.' and '-' (no ':' or '@')"
            )
        if num_epochs < 0 or limit < 0:
            raise InvalidArgument(
                f"dataset {name!r}: num_epochs ({num_epochs}) and limit ({limit}) must be >= 0"
            )
        # Loaded before (a restart): Redis has its prompts, the file is not needed again.
        known = await self.db.loaded_dataset(name, str(Path(path).resolve()), kind, num_epochs)
        if known is not None:
            return known, False
        rows = await asyncio.to_thread(
            read_dataset,
            path,
            prompt=prompt,
            answer=answer,
            metadata=metadata,
            limit=limit,
            **(source or {}),
        )
        return await self.db.load_dataset(
            name, str(Path(path).resolve()), kind, rows, num_epochs, seed
        )

    async def _refresh_gauges(self) -> None:
        while True:
            try:
                stats = await self.db.stats()
                m.POLICY_VERSION.set(stats["policy_version"])
                for kind, s in stats["kinds"].items():
                    m.GROUPS_PENDING.labels(kind).set(s["groups_pending"])
                    m.GROUPS_IN_BATCHES.labels(kind).set(s["groups_in_batches"])
                    m.BATCHES_UNACKED.labels(kind).set(s["batches_unacked"])
                    m.GROUPS_HELD.labels(kind).set(s["groups_held"])
                    m.BATCHES_HELD.labels(kind).set(s["batches_held"])
                    if "prompts_leased" in s:
                        m.PROMPTS_LEASED.labels(kind).set(s["prompts_leased"])
            except Exception as exc:  # metrics must never take the service down
                log.debug("gauges.refresh_failed", error=str(exc))
            await asyncio.sleep(STATS_REFRESH_SECONDS)

    def register(self, server: grpc.aio.Server) -> None:
        rq, rs = "FromString", "SerializeToString"
        methods: dict[str, tuple[Callable[..., Any], type, type]] = {
            "LoadDataset": (self.LoadDataset, bpb.LoadDatasetRequest, bpb.LoadDatasetResponse),
            "LeasePrompts": (self.LeasePrompts, bpb.LeasePromptsRequest, bpb.LeasePromptsResponse),
            "ReleasePrompts": (
                self.ReleasePrompts,
                bpb.ReleasePromptsRequest,
                bpb.ReleasePromptsResponse,
            ),
            "PutTrajectories": (
                self.PutTrajectories,
                bpb.PutTrajectoriesRequest,
                bpb.PutTrajectoriesResponse,
            ),
            "GetBatch": (self.GetBatch, bpb.GetBatchRequest, bpb.GetBatchResponse),
            "Ack": (self.Ack, bpb.AckRequest, bpb.AckResponse),
            "SetPolicyVersion": (
                self.SetPolicyVersion,
                bpb.SetPolicyVersionRequest,
                bpb.SetPolicyVersionResponse,
            ),
            "GetStats": (self.GetStats, bpb.GetStatsRequest, bpb.GetStatsResponse),
            "StartEval": (self.StartEval, bpb.StartEvalRequest, bpb.StartEvalResponse),
        }
        handlers = {}
        for method, (fn, req, resp) in methods.items():
            serializer = getattr(resp, rs)
            deserializer = getattr(req, rq)
            if method == "GetBatch":
                # GetBatch may answer with pre-encoded bytes (see encode_batch).
                serializer = _bytes_or_proto
            if method == "PutTrajectories":
                # Keep the request's bytes: the groups in it are stored as they are.
                deserializer = RawPutRequest.parse
            handlers[method] = grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=deserializer, response_serializer=serializer
            )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )

    # -- prompts ------------------------------------------------------------------------------

    async def LoadDataset(
        self, request: bpb.LoadDatasetRequest, context: grpc.aio.ServicerContext
    ) -> bpb.LoadDatasetResponse:
        kind = _kind(request.kind)
        if kind == "sft":
            raise _reject(
                "LoadDataset",
                "bad_request",
                InvalidArgument("SFT has no prompt stream: load prompts as TRAIN or EVAL"),
            )
        if not request.path:
            raise _reject("LoadDataset", "bad_request", InvalidArgument("path is empty"))
        epochs = request.num_epochs or (self.config.data.num_epochs if kind == "train" else 1)
        try:
            n, loaded = await self._load(
                path=request.path,
                name=request.name,
                kind=kind,
                prompt=request.columns.prompt or "prompt",
                answer=request.columns.answer or "answer",
                metadata=list(request.columns.metadata),
                limit=request.limit,
                num_epochs=epochs,
                seed=request.seed or self.config.job.seed,
            )
        except InvalidArgument as exc:
            raise _reject("LoadDataset", "bad_dataset", exc) from None
        return bpb.LoadDatasetResponse(num_prompts=n, loaded=loaded)

    async def LeasePrompts(
        self, request: bpb.LeasePromptsRequest, context: grpc.aio.ServicerContext
    ) -> bpb.LeasePromptsResponse:
        kind = _kind(request.kind)
        if kind == "sft":
            raise _reject(
                "LeasePrompts",
                "bad_request",
                InvalidArgument(
                    "SFT has no prompt stream: rejection sampling leases TRAIN prompts and puts "
                    "its kept samples as SFT groups"
                ),
            )
        if request.max_prompts <= 0:
            raise _reject(
                "LeasePrompts",
                "bad_request",
                InvalidArgument(f"max_prompts must be > 0, got {request.max_prompts}"),
            )
        if not request.consumer:
            raise _reject(
                "LeasePrompts",
                "bad_request",
                InvalidArgument("consumer is empty: name the rollout replica (e.g. its pod name)"),
            )
        _bounded("LeasePrompts", "consumer", len(request.consumer), MAX_NAME_CHARS)
        n = min(request.max_prompts, MAX_LEASE)
        wait = _wait_seconds("LeasePrompts", request.wait_seconds)
        arrived = time.monotonic()
        deadline = arrived + wait
        held = 0.0  # seconds spent waiting for room (not in Redis)
        poll = LEASE_POLL_SECONDS
        while True:
            # While the window is full, look again whenever this replica frees room and after
            # `poll` (another replica's Ack), counting one refusal at the end only.
            last = time.monotonic() >= deadline
            res = await self.db.lease(kind, n, request.consumer, count_refusal=last)
            if not res.busy or last:
                break
            pause = time.monotonic()
            await self._room.wait(min(poll, deadline - pause))
            held += time.monotonic() - pause
            poll = min(2 * poll, LEASE_POLL_MAX_SECONDS)
        m.LEASE_WAIT_SECONDS.labels(kind).observe(held)
        if res.busy:
            m.LEASES_REFUSED_TOTAL.labels(kind).inc()
            retry = self.cfg.backpressure_retry_seconds
            raise ResourceExhausted(
                f"{res.inflight} groups are leased or waiting for training "
                f"(max_inflight_groups={self.cfg.max_inflight_groups}); retry in {retry:g}s",
                retry_after_seconds=retry,
            )
        fresh = sum(1 for p in res.prompts if p.deliveries <= 1)
        m.LEASES_TOTAL.labels(kind, "first").inc(fresh)
        m.LEASES_TOTAL.labels(kind, "redelivery").inc(len(res.prompts) - fresh)
        return bpb.LeasePromptsResponse(
            prompts=[
                tpb.Prompt(
                    prompt_id=p.prompt_id,
                    epoch=p.epoch,
                    text=p.payload.get("t", ""),
                    answer=p.payload.get("a", ""),
                    metadata_json=p.payload.get("m", ""),
                    lease_id=p.lease_id,
                    delivery_count=p.deliveries,
                )
                for p in res.prompts
            ],
            policy_version=res.policy_version,
            exhausted=res.exhausted,
        )

    async def ReleasePrompts(
        self, request: bpb.ReleasePromptsRequest, context: grpc.aio.ServicerContext
    ) -> bpb.ReleasePromptsResponse:
        kind = lease_kind(_kind(request.kind))
        if not request.consumer:
            raise _reject("ReleasePrompts", "bad_request", InvalidArgument("consumer is empty"))
        _bounded("ReleasePrompts", "lease_ids", len(request.lease_ids), MAX_RELEASE_IDS)
        _bounded("ReleasePrompts", "consumer", len(request.consumer), MAX_NAME_CHARS)
        n = await self.db.release(kind, request.consumer, list(request.lease_ids))
        m.PROMPTS_RELEASED_TOTAL.labels(kind).inc(n)
        if n:
            self._room.notify()
        return bpb.ReleasePromptsResponse(released=n)

    async def StartEval(
        self, request: bpb.StartEvalRequest, context: grpc.aio.ServicerContext
    ) -> bpb.StartEvalResponse:
        if not 0 <= request.round < MAX_EXACT_INT:
            raise _reject(
                "StartEval",
                "bad_request",
                InvalidArgument(f"round must be in 0..{MAX_EXACT_INT - 1}, got {request.round}"),
            )
        rounds, started, num = await self.db.start_eval(request.round)
        if num == 0:
            raise _reject(
                "StartEval",
                "no_eval_data",
                FailedPrecondition("no eval dataset is loaded (data.eval in the job file)"),
            )
        return bpb.StartEvalResponse(rounds=rounds, num_prompts=num, started=started)

    # -- groups -------------------------------------------------------------------------------

    async def PutTrajectories(
        self,
        request: bpb.PutTrajectoriesRequest | RawPutRequest,
        context: grpc.aio.ServicerContext,
    ) -> bpb.PutTrajectoriesResponse:
        # Over gRPC the request arrives with its bytes (see register), so the groups' bytes are
        # stored as sent; in-process callers pass the message and the groups are encoded anew.
        raw = request.data if isinstance(request, RawPutRequest) else None
        if isinstance(request, RawPutRequest):
            request = request.message
        kind = _kind(request.kind)
        if not request.groups:
            raise _reject("PutTrajectories", "bad_request", InvalidArgument("no groups to put"))
        _bounded("PutTrajectories", "groups", len(request.groups), MAX_PUT_GROUPS)
        groups = request.groups
        checked = []
        for i, msg in enumerate(groups):
            try:
                c = check_group(msg, self.group_size, partial=kind == "sft")
            except TrajectoryError as exc:
                m.GROUPS_PUT_TOTAL.labels(kind, "rejected").inc(len(groups))
                raise _reject(
                    "PutTrajectories", "invalid_group", InvalidArgument(f"groups[{i}]: {exc}")
                ) from None
            refusal = self.limits.refusal(kind, c)
            if refusal is not None:
                m.GROUPS_PUT_TOTAL.labels(kind, "rejected").inc(len(groups))
                raise _reject(
                    "PutTrajectories", refusal[0], InvalidArgument(f"groups[{i}]: {refusal[1]}")
                )
            checked.append(c)
        if len(request.lease_ids) != len(groups):
            m.GROUPS_PUT_TOTAL.labels(kind, "rejected").inc(len(groups))
            raise _reject(
                "PutTrajectories",
                "no_lease",
                InvalidArgument(
                    f"{len(request.lease_ids)} lease_ids for {len(groups)} groups: give "
                    "each group the lease_id LeasePrompts gave its prompt (same order)"
                ),
            )
        payloads = group_payloads(groups, checked, raw)
        leases = request.lease_ids
        items = [
            PutItem(
                prompt_id=c.prompt_id,
                epoch=c.epoch,
                version=c.version,
                zero_variance=c.zero_variance,
                payload=payload,
                lease_id=lease,
            )
            for c, payload, lease in zip(checked, payloads, leases, strict=True)
        ]
        try:
            accepted = await self.db.put(kind, items)
        except InvalidArgument as exc:
            m.GROUPS_PUT_TOTAL.labels(kind, "rejected").inc(len(items))
            reason = "no_lease" if "not live" in str(exc) else "unknown_prompt_or_lease"
            raise _reject("PutTrajectories", reason, exc) from None
        n_acc = sum(accepted)
        m.GROUPS_PUT_TOTAL.labels(kind, "accepted").inc(n_acc)
        if n_acc < len(accepted):
            self._room.notify()  # a duplicate ends its lease without adding a group
        m.GROUPS_PUT_TOTAL.labels(kind, "duplicate").inc(len(accepted) - n_acc)
        if len(items) == 1 and not accepted[0]:
            it = items[0]
            raise AlreadyExists(
                f"a group for prompt {it.prompt_id!r} epoch {it.epoch} was accepted before; "
                "this one was discarded"
            )
        return bpb.PutTrajectoriesResponse(
            results=[
                bpb.PutResult(
                    group_id=c.group_id,
                    status=bpb.PUT_STATUS_ACCEPTED if ok else bpb.PUT_STATUS_DUPLICATE,
                )
                for c, ok in zip(checked, accepted, strict=True)
            ]
        )

    # -- batches ------------------------------------------------------------------------------

    def _verdict(
        self, kind: str, g: StoredGroup, max_staleness: int, current_version: int
    ) -> str | None:
        """Why a group is dropped from a batch, or None to keep it. Only training groups are
        filtered: eval results are measurements and SFT samples are off-policy by design."""
        if kind != "train":
            return None
        age = _age_verdict(g, max_staleness, current_version)
        if age is not None:
            return age
        if self.cfg.dynamic_sampling and g.zero_variance:
            return "zero_variance"
        if self.filters:
            if not g.payload:
                return "missing_payload"  # only if Redis lost data (see docs/buffer.md)
            group = Group.from_proto(tpb.Group.FromString(g.payload))
            for spec, fn in self.filters:
                try:
                    keep = fn(group)
                    if not isinstance(keep, bool | np.bool_):
                        # A missing return (None) must not silently drop every group.
                        raise TypeError(f"returned {type(keep).__name__}, not a bool")
                except (Exception, SystemExit, KeyboardInterrupt) as exc:
                    # A broken filter must not lose data or stop training: the group is kept.
                    m.FILTER_ERRORS_TOTAL.labels(spec).inc()
                    log.warning("filter.failed", filter=spec, error=f"{type(exc).__name__}: {exc}")
                    continue
                if not keep:
                    return f"filter:{spec}"
        return None

    async def GetBatch(
        self, request: bpb.GetBatchRequest, context: grpc.aio.ServicerContext
    ) -> bytes | bpb.GetBatchResponse:
        kind = _kind(request.kind)
        want = request.num_groups
        if want <= 0:
            raise _reject(
                "GetBatch", "bad_request", InvalidArgument(f"num_groups must be > 0, got {want}")
            )
        _bounded("GetBatch", "num_groups", want, MAX_BATCH_GROUPS)
        consumer = request.consumer or "trainer"
        if consumer not in TRAINER_CONSUMERS:
            raise _reject(
                "GetBatch",
                "foreign_consumer",
                InvalidArgument(
                    f"consumer {consumer[:64]!r} is not the trainer's: only "
                    f"{', '.join(sorted(TRAINER_CONSUMERS))} read groups (another reader would "
                    "take them away from training)"
                ),
            )
        wait = _wait_seconds("GetBatch", request.wait_seconds)
        db = self.db
        ack_id, hold = request.ack_batch_id, request.hold
        ack = -2
        if ack_id and not ack_id.startswith(f"{kind}-"):  # another kind's: its own call
            ack = await self._ack(ack_id, "GetBatch", hold=hold)
            ack_id = ""
        if request.reopen_held:
            reopened = await db.reopen_held(kind)
            if reopened:
                log.info("batches.reopened", kind=kind, batches=reopened)

        # 1. A batch handed out before and not acknowledged in time goes first, unchanged. The
        #    first TAKE looks for one (and acknowledges `ack_batch_id`) before taking anything.
        batch_id = f"{kind}-{uuid.uuid4().hex}"
        hold_ms = int((wait + self.cfg.batch_ack_timeout_seconds) * 1000)
        pending: list[StoredGroup] = []
        last_id = "0-0"
        while True:
            taken = await db.take(
                kind,
                consumer,
                want,
                batch_id,
                int(time.time() * 1000) + hold_ms,
                ack_batch_id=ack_id,
                hold=hold,
                reclaim=True,
            )
            if ack_id:
                if taken.ack == -1:
                    raise self._unknown_batch("GetBatch", ack_id)
                ack, ack_id = taken.ack, ""
                self._count_ack(kind, ack, hold)
            if taken.reclaimed is None:
                pending, last_id = taken.groups, taken.last_id
                break
            fetched = await db.fetch(kind, taken.reclaimed)
            if fetched is None:  # acknowledged meanwhile: look again
                continue
            state, groups = fetched
            outdated = kind == "train" and any(
                _age_verdict(g, request.max_staleness, request.current_version) for g in groups
            )
            if state == "issued" and outdated:
                # Too old for the trainer now (a batch re-delivered long after it was taken):
                # assembled anew, through the filters, instead of trained beyond max_staleness.
                if not await db.reassemble(kind, taken.reclaimed):
                    continue  # acknowledged meanwhile
                state = "assembling"
                log.info("batch.reassembled", batch_id=taken.reclaimed, groups=len(groups))
            if state == "issued":
                m.BATCHES_TOTAL.labels(kind, "redelivered").inc()
                log.info("batch.redelivered", batch_id=taken.reclaimed, groups=len(groups))
                head = bpb.GetBatchResponse(
                    batch_id=taken.reclaimed, redelivered=True, ack_already_acked=ack == 0
                )
                return encode_batch(head, [g.payload for g in groups if g.payload])
            # Taken by a replica that died before handing it out: assemble it anew.
            batch_id, pending = taken.reclaimed, groups
            break

        # 2. New groups, oldest first, through the filters, until `want` are kept or time is up.
        #    The verdicts need only the groups' metadata, unless custom filters are set; the
        #    kept groups' bytes are then read in the transaction that issues the batch.
        deadline = time.monotonic() + wait
        kept: list[StoredGroup] = []
        drops: list[Drop] = []  # every drop of this call (counted in the response)
        unsent = 0  # drops[unsent:] are not applied in Redis yet
        while True:
            if self.filters:  # groups of a recovered batch have their bytes already
                pending = await db.payloads(kind, pending)
            for g in pending:
                if len(kept) >= want:
                    break  # left over from a recovered batch: finalize puts it back
                reason = self._verdict(kind, g, request.max_staleness, request.current_version)
                if reason is None:
                    kept.append(g)
                else:
                    requeue = reason == "future_version" or (
                        reason == "stale" and self.cfg.requeue_stale
                    )
                    drops.append(Drop(g, reason, requeue))
            got_any, pending = bool(pending), []
            if len(kept) >= want:
                break
            if len(drops) > unsent:
                # Applied now, not with the batch: a dropped group must stop counting against
                # max_inflight_groups (and a stale one's prompt be re-queued) before this call
                # waits for the rollouts to make more.
                await db.drop(kind, drops[unsent:])
                unsent = len(drops)
                self._room.notify()
            if not got_any:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                await db.wait_for_groups(kind, last_id, remaining)
            taken = await db.take(
                kind, consumer, want - len(kept), batch_id, int(time.time() * 1000) + hold_ms
            )
            pending, last_id = taken.groups, taken.last_id

        _, kept = await db.finish(kind, batch_id, kept, drops[unsent:])
        if len(drops) > unsent:
            self._room.notify()
        dropped = Counter(d.reason for d in drops)
        for d in drops:
            m.GROUPS_DROPPED_TOTAL.labels(kind, d.reason).inc()
        # Bytes missing only if Redis lost data (see docs/buffer.md): counted, not sent; the
        # entry leaves the stream with the batch's Ack.
        missing = sum(1 for g in kept if not g.payload)
        if missing:
            dropped["missing_payload"] += missing
            m.GROUPS_DROPPED_TOTAL.labels(kind, "missing_payload").inc(missing)
        payloads = [g.payload for g in kept if g.payload]
        if not kept:
            exhausted = await db.exhausted(kind)
            return bpb.GetBatchResponse(
                dropped=dict(dropped), exhausted=exhausted, ack_already_acked=ack == 0
            )
        m.BATCHES_TOTAL.labels(kind, "new").inc()
        m.GROUPS_DELIVERED_TOTAL.labels(kind).inc(len(payloads))
        for g in kept:
            m.STALENESS.labels(kind).observe(max(0, request.current_version - g.version))
        head = bpb.GetBatchResponse(
            batch_id=batch_id, dropped=dict(dropped), ack_already_acked=ack == 0
        )
        return encode_batch(head, payloads)

    def _unknown_batch(self, method: str, batch_id: str) -> Exception:
        return _reject(
            method,
            "unknown_batch",
            NotFound(
                f"batch {batch_id!r} is unknown: never handed out, or acknowledged "
                f"more than acked_batch_ttl_seconds={self.cfg.acked_batch_ttl_seconds:g} ago"
            ),
        )

    async def _ack(self, batch_id: str, method: str, *, hold: bool = False) -> int:
        """Acknowledge (or hold) a batch on its own: 1 now, 0 before; NOT_FOUND when unknown."""
        kind, _, rest = batch_id.partition("-")
        if kind not in ("train", "eval", "sft") or not rest:
            raise _reject(
                method, "unknown_batch", NotFound(f"batch {batch_id!r} is not a batch id")
            )
        res = await self.db.ack(kind, batch_id, hold=hold)
        if res < 0:
            raise self._unknown_batch(method, batch_id)
        self._count_ack(kind, res, hold)
        return res

    def _count_ack(self, kind: str, res: int, hold: bool) -> None:
        """Count an acknowledgement's result; one that frees room in the in-flight window (a
        batch acknowledged or held now) wakes the leases waiting for it."""
        verb = "held" if hold else "acked"
        m.ACKS_TOTAL.labels(kind, verb if res == 1 else f"already_{verb}").inc()
        if res == 1:
            self._room.notify()

    async def Ack(
        self, request: bpb.AckRequest, context: grpc.aio.ServicerContext
    ) -> bpb.AckResponse:
        res = await self._ack(request.batch_id, "Ack", hold=request.hold)
        return bpb.AckResponse(already_acked=res == 0)

    # -- job state ----------------------------------------------------------------------------

    async def _version_bound(self) -> int | None:
        """The highest policy version the trainer can have reached: weight-sync's latest plus
        `publish_every` (the trainer sets a version before it publishes it). None when the job
        publishes no weights or weight-sync does not answer (then only forward is checked)."""
        if self._weight_sync is None:
            return None
        from kuberl.api.weight_sync.v1 import weight_sync_pb2

        try:
            answer = await self._weight_sync.GetVersion(
                weight_sync_pb2.GetVersionRequest(), timeout=VERSION_CHECK_SECONDS
            )
        except grpc.RpcError as exc:
            m.REJECTIONS_TOTAL.labels("SetPolicyVersion", "unchecked").inc()
            log.warning("version.unchecked", error=str(exc)[:200])
            return None
        return int(answer.version) + self.config.trainer.publish_every

    async def SetPolicyVersion(
        self, request: bpb.SetPolicyVersionRequest, context: grpc.aio.ServicerContext
    ) -> bpb.SetPolicyVersionResponse:
        if not 0 <= request.version <= MAX_EXACT_INT:
            raise _reject(
                "SetPolicyVersion",
                "bad_request",
                InvalidArgument(f"version must be in 0..{MAX_EXACT_INT}, got {request.version}"),
            )
        bound = await self._version_bound()
        if bound is not None and request.version > bound:
            # A version the trainer cannot have reached would hold every replica for
            # version_wait_seconds before each batch, for good (versions never go down).
            raise _reject(
                "SetPolicyVersion",
                "version_ahead",
                FailedPrecondition(
                    f"policy version {request.version} is ahead of the weights: weight-sync "
                    f"holds {bound - self.config.trainer.publish_every}, so the trainer is at "
                    f"most at {bound} (trainer.publish_every="
                    f"{self.config.trainer.publish_every})"
                ),
            )
        ok, version = await self.db.set_policy_version(request.version)
        if not ok:
            raise _reject(
                "SetPolicyVersion",
                "version_conflict",
                FailedPrecondition(
                    f"policy version {request.version} is lower than the job's current version "
                    f"{version}; versions only go up"
                ),
            )
        m.POLICY_VERSION.set(version)
        return bpb.SetPolicyVersionResponse(version=version)

    async def GetStats(
        self, request: bpb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> bpb.GetStatsResponse:
        return stats_response(await self.db.stats(), await self.db.exhausted("train"))


def _bytes_or_proto(response: bytes | bpb.GetBatchResponse) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()


def stats_response(stats: dict[str, Any], exhausted: bool) -> bpb.GetStatsResponse:
    """GetStats' answer from `BufferStore.stats()`: TRAIN in the fields, the rest in counters."""
    train = stats["kinds"]["train"]
    counters = dict(stats["counters"])
    for kind, values in stats["kinds"].items():
        for key, value in values.items():
            counters[f"{kind}:{key}"] = value
    return bpb.GetStatsResponse(
        job=stats["job"],
        policy_version=stats["policy_version"],
        epoch=stats["epoch"],
        cursor=stats["cursor"],
        prompts_total=train["prompts_total"],
        prompts_leased=train["prompts_leased"],
        groups_pending=train["groups_pending"],
        batches_unacked=train["batches_unacked"],
        counters=counters,
        batches_held=train["batches_held"],
        groups_held=train["groups_held"],
        exhausted=exhausted,
    )


def create_service(config: JobConfig) -> BufferService:
    """The entrypoint `kuberl serve buffer` calls (it also tunes this process' allocator)."""
    keep_freed_memory()
    return BufferService(config)
