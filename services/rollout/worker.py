"""The rollout loop of one replica: lease prompts, generate, score, put whole groups.

`RolloutWorker.run` keeps up to `rollout.batches_in_flight` batches in flight. Each batch is
`prompts_per_batch` prompts leased from the buffer; every prompt goes through the job's rollout
function (n samples, see `kuberl.rollout.functions`), the batch's samples are scored in one
`Score` call to the reward service, and the finished groups are put in one `PutTrajectories`
call with their lease ids, which completes the leases. Trajectories carry the policy version at
the start and end of generation, the engine's logprobs, the loss mask, timings and metadata.

Nothing leased is dropped silently. Every prompt leaves the replica either inside a group the
buffer accepted, or through `ReleasePrompts` (generation failed, scoring or putting failed after
`max_attempts` retries, shutdown); only a crash (SIGKILL) or a buffer it cannot reach (a
network partition: the release fails too, and the prompts are counted `abandoned`) leaves
leases behind, and the buffer re-delivers those after its lease timeout. Transient errors
(UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) are retried with exponential backoff; a
refused lease (backpressure) waits for the `retry-after-seconds` trailer. A batch whose every
prompt failed in the rollout function or the tokenizer releases its prompts at once and then
holds its slot for the same exponential backoff (reset by the next group made), so a function
that fails at once does not spin through the prompt stream.

Modes (`rollout.mode`): `rl` puts training groups (and serves the EVAL stream first when the job
has eval data); `eval` leases and puts only EVAL groups; `rejection_sampling` leases training
prompts and puts, to the SFT stream, only the samples whose reward is >= `rejection_threshold`
(possibly none: the empty group completes the lease).

Weight updates (`apply_weight_update`): new generations wait; with `on_weight_update: finish` the
running ones complete on the old weights (their trajectories say so in
`metadata.weight_update`), with `abort` they are aborted and regenerated from scratch on the new
weights; then the engine loads the weights and resumes. Draining (SIGTERM, Drain RPC): stop
leasing, let in-flight batches finish for `drain_seconds`, then abort generation and release
whatever is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.api.common.v1 import trajectory_pb2 as tpb
from kuberl.api.reward.v1 import reward_pb2 as rpb
from kuberl.common.buffer_client import encode_put
from kuberl.common.config import JobConfig
from kuberl.common.logs import get_logger
from kuberl.common.server import RETRY_AFTER_KEY
from kuberl.common.trajectory import FINISH_REASONS, Group, Trajectory, encode_array
from kuberl.rollout import metrics as m
from kuberl.rollout.engine.base import Engine, SamplingParams
from kuberl.rollout.functions import (
    PromptItem,
    RolloutContext,
    RolloutFn,
    RolloutSample,
    encode_prompt,
    load_rollout_function,
    prompt_metadata,
)

log = get_logger(__name__)

KINDS = {"train": tpb.STREAM_KIND_TRAIN, "eval": tpb.STREAM_KIND_EVAL, "sft": tpb.STREAM_KIND_SFT}
TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
}
# A group aborted this many times (weight updates, pauses) is released to the buffer instead.
MAX_REGENERATIONS = 8
#: How long resuming or aborting the engine may take (its own retries included) before the
#: replica goes on without it.
CONTROL_SECONDS = 30.0


class CallFailed(Exception):
    """A buffer / reward call failed for good (non-transient code or retries exhausted)."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method}: {code.name}: {details}")
        self.code = code


@dataclass(eq=False)
class _Generation:
    """One prompt's group while its rollout function runs."""

    item: PromptItem
    finished_on_old: list[int] = field(default_factory=list)  # updates it finished before
    aborted_by: list[int] = field(default_factory=list)  # updates that aborted it


@dataclass
class _Done:
    item: PromptItem
    samples: list[RolloutSample]
    queued_seconds: float
    generate_seconds: float
    metadata: dict[str, Any]
    texts: list[str]  # each sample's decoded response: the reward's input and the trajectory's


def retry_after(exc: grpc.aio.AioRpcError, default: float) -> float:
    """The server's `retry-after-seconds` trailer, or default."""
    for key, value in exc.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, float(value))
            except (TypeError, ValueError):
                break
    return default


def oldest_trainable_version(policy_version: int, max_staleness: int, publish_every: int) -> int:
    """The oldest weights whose groups the trainer, now at `policy_version`, will still train
    (`max_staleness` >= 0), capped at the newest version it has published (one in every
    `publish_every`)."""
    return min(policy_version - max_staleness, policy_version // publish_every * publish_every)


class RolloutWorker:
    """One replica's loop. `run()` until `drain()`; control calls come from the RPC servicer."""

    def __init__(
        self,
        config: JobConfig,
        engine: Engine,
        tokenizer: Any,
        *,
        buffer: Any,
        reward: Any,
        replica_id: str,
        rollout_fn: RolloutFn | None = None,
    ) -> None:
        self.config = config
        self.rc = config.rollout
        self.engine = engine
        self.tokenizer = tokenizer
        self.buffer = buffer  # kuberl.common.buffer_client.BufferStub (grpc.aio)
        self.reward = reward  # RewardServiceStub (grpc.aio)
        self.replica_id = replica_id
        self.rollout_fn = rollout_fn or load_rollout_function(config)
        tools = None
        if self.rc.multi_turn.enabled and not self.rc.rollout_function:
            from kuberl.rollout.tools import ToolRegistry

            tools = ToolRegistry.from_config(self.rc.multi_turn)
        #: Shown to the model by its chat template (`multi_turn.describe_tools`).
        self._tool_schemas = (
            tools.schemas() if tools is not None and self.rc.multi_turn.describe_tools else None
        )
        self.ctx = RolloutContext(
            engine=engine,
            tokenizer=tokenizer,
            sampling=SamplingParams.from_config(self.rc.sampling, n=self.rc.group_size),
            config=config,
            tools=tools,
        )
        if self.rc.mode == "eval":
            self.lease_kinds = ["eval"]
        elif self.rc.mode == "rejection_sampling":
            self.lease_kinds = ["train"]
        else:
            self.lease_kinds = ["eval", "train"] if config.data.eval else ["train"]
        self.state = "starting"
        self.exhausted = False
        self.groups_put = 0
        self.generated_tokens = 0
        self.prompts_put = 0
        self.prompts_released = 0
        self._stopping = False  # draining: no new leases
        self._aborting = False  # draining past its timeout: no new generations
        self._paused = False
        self._stop = asyncio.Event()
        self._lease_gate = asyncio.Event()  # cleared while paused
        self._lease_gate.set()
        self._gen_gate = asyncio.Event()  # cleared while weights are being updated
        self._gen_gate.set()
        self._slots = asyncio.Semaphore(self.rc.batches_in_flight)
        self._batches: set[asyncio.Task[None]] = set()
        self._inflight: dict[str, str] = {}  # lease id -> kind
        self._generating: set[_Generation] = set()
        self._gen_changed = asyncio.Condition()
        self._update_lock = asyncio.Lock()
        self._version_changed = asyncio.Condition()  # notified after every weight update
        # Prompts in a row whose group could not be made (rollout function or tokenizer errors):
        # a batch that yields nothing for this reason backs off before its slot frees.
        self._gen_errors = 0
        # True while a weight update holds the engine paused to load (resume must not undo it);
        # a `finish` update waiting for generations does not, and needs the engine running.
        self._loading = False
        self._run_finished = asyncio.Event()  # run() is not leasing (set until it starts)
        self._run_finished.set()

    # -- the loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Lease and dispatch batches until draining starts."""
        self._run_finished.clear()
        try:
            await self._run()
        finally:
            self._run_finished.set()

    async def _run(self) -> None:
        self.state = "running" if not self._paused else "paused"
        failures = 0
        while not self._stopping:
            await self._lease_gate.wait()
            if not await self._acquire_slot():
                break
            try:
                got = await self._lease()
                failures = 0
            except _Wait as wait:
                self._slots.release()
                await self._sleep(wait.seconds)
                continue
            except CallFailed as exc:
                self._slots.release()
                failures += 1
                m.FAILURES.labels("lease").inc()
                delay = self._backoff(failures)
                log.warning("lease.failed", error=str(exc), retry_in=round(delay, 2))
                await self._sleep(delay)
                continue
            if got is None:
                self._slots.release()
                await self._sleep(self.rc.idle_poll_seconds)
                continue
            kind, prompts, version = got
            if self._stopping:  # the drain began while this lease was in flight
                await self._release(kind, [p.lease_id for p in prompts])
                self._slots.release()
                break
            task = asyncio.create_task(self._process_batch(kind, prompts, version))
            self._batches.add(task)
            task.add_done_callback(self._batch_done)

    async def _acquire_slot(self) -> bool:
        """Wait for a free batch slot; False (holding none) once draining starts."""
        acquire = asyncio.ensure_future(self._slots.acquire())
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({acquire, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not acquire.done():
            acquire.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquire
        if acquire.done() and not acquire.cancelled() and self._stopping:
            self._slots.release()
        return acquire.done() and not acquire.cancelled() and not self._stopping

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._batches.discard(task)
        self._slots.release()
        if not task.cancelled() and task.exception() is not None:
            log.error("batch.crashed", error=repr(task.exception()))

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    def _backoff(self, attempt: int) -> float:
        return min(self.rc.retry_max_seconds, self.rc.retry_initial_seconds * 2 ** (attempt - 1))

    async def _lease(self) -> tuple[str, list[tpb.Prompt], int] | None:
        """(kind, prompts, the job's policy version) of a lease; None when nothing was leased."""
        exhausted = True
        for kind in self.lease_kinds:
            request = bpb.LeasePromptsRequest(
                max_prompts=self.rc.prompts_per_batch,
                consumer=self.replica_id,
                kind=KINDS[kind],
                wait_seconds=self.rc.lease_wait_seconds,
            )
            try:
                answer = await self.buffer.LeasePrompts(
                    request, timeout=self.rc.rpc_timeout_seconds + self.rc.lease_wait_seconds
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    m.BACKPRESSURE.inc()
                    wait = retry_after(exc, self.rc.idle_poll_seconds)
                    log.debug("lease.backpressure", kind=kind, retry_after=wait)
                    raise _Wait(wait) from None
                raise CallFailed("LeasePrompts", exc.code(), exc.details() or "") from None
            if answer.prompts:
                self.exhausted = False
                for p in answer.prompts:
                    self._inflight[p.lease_id] = kind
                m.PROMPTS.labels(kind, "leased").inc(len(answer.prompts))
                m.IN_FLIGHT.set(len(self._inflight))
                return kind, list(answer.prompts), answer.policy_version
            exhausted = exhausted and answer.exhausted
        if exhausted and not self.exhausted:
            log.info("lease.exhausted", kinds=",".join(self.lease_kinds))
        self.exhausted = exhausted
        return None

    # -- one batch ----------------------------------------------------------------------------

    async def _process_batch(
        self, kind: str, prompts: Sequence[tpb.Prompt], policy_version: int
    ) -> None:
        leased_at = time.monotonic()
        lease_ids = [p.lease_id for p in prompts]
        failed = False
        try:
            if kind == "train":
                await self._await_trainable_weights(policy_version)
            m.BATCH_SIZE.observe(len(prompts) * self.rc.group_size)
            items = []
            for p in prompts:
                try:
                    ids = encode_prompt(
                        self.tokenizer, p.text, self.config.model.chat_template, self._tool_schemas
                    )
                except Exception as exc:
                    log.error("prompt.tokenize_failed", prompt_id=p.prompt_id, error=repr(exc))
                    m.FAILURES.labels("tokenize").inc()
                    self._gen_errors += 1
                    continue  # released in `finally`
                items.append(
                    PromptItem(
                        prompt_id=p.prompt_id,
                        epoch=p.epoch,
                        text=p.text,
                        answer=p.answer,
                        token_ids=ids,
                        metadata=prompt_metadata(p.metadata_json),
                        kind=kind,
                        lease_id=p.lease_id,
                        delivery_count=p.delivery_count,
                    )
                )
            results = await asyncio.gather(*(self._generate_group(i, leased_at) for i in items))
            done = [r for r in results if r is not None]
            if not done:
                failed = self._gen_errors > 0
                return
            try:
                rewards, score_seconds = await self._score(done)
            except CallFailed as exc:
                m.FAILURES.labels("score").inc()
                log.error("batch.score_failed", prompts=len(done), error=str(exc))
                return  # released in `finally`
            groups = [self._group(d, rewards, score_seconds, kind) for d in done]
            await self._put(kind, groups, [d.item.lease_id for d in done])
        except Exception as exc:  # a defect, not an outage: count it and back off like one
            m.FAILURES.labels("batch").inc()
            self._gen_errors += 1
            failed = True
            log.error("batch.failed", prompts=len(prompts), error=f"{exc!r}"[:500])
        finally:
            left = [lid for lid in lease_ids if lid in self._inflight]
            if left:
                await asyncio.shield(self._release(kind, left))
            if failed:
                # Released first (another replica may succeed), then hold this batch's slot so a
                # function that fails at once does not spin through the prompt stream.
                delay = self._backoff(self._gen_errors)
                log.warning("batch.generate_failed", errors=self._gen_errors, retry_in=delay)
                await self._sleep(delay)

    async def _generate_group(self, item: PromptItem, leased_at: float) -> _Done | None:
        """The group of one prompt, regenerated after aborts; None when it was released."""
        gen = _Generation(item)
        attempts = 0
        while True:
            await self._gen_gate.wait()
            if self._aborting:
                return None  # the drain gave up on in-flight work: released by the batch
            started = time.monotonic()
            updates_before = len(gen.aborted_by)
            self._generating.add(gen)
            try:
                version_before = self.engine.version
                samples = await self.rollout_fn(self.ctx, item)
                if len(samples) != self.rc.group_size:
                    raise ValueError(
                        f"the rollout function returned {len(samples)} samples for a group of "
                        f"{self.rc.group_size}"
                    )
                for s in samples:
                    s.check()
                    # A custom function that leaves them out gets the engine's versions (once
                    # 0, which the buffer dropped as stale again and again).
                    if s.version_start is None:
                        s.version_start = version_before
                    if s.version_end is None:
                        s.version_end = self.engine.version
            except Exception as exc:
                m.REQUESTS.labels("error").inc()
                m.FAILURES.labels("generate").inc()
                self._gen_errors += 1
                log.error(
                    "prompt.generate_failed", prompt_id=item.prompt_id, error=f"{exc!r}"[:500]
                )
                return None
            finally:
                self._generating.discard(gen)
                async with self._gen_changed:
                    self._gen_changed.notify_all()
            aborted = sum(s.finish_reason == "abort" for s in samples)
            updated = len(gen.aborted_by) > updates_before
            if updated and not aborted:
                # An `abort` update found this group between engine calls (a multi-turn sample
                # running its tool, a custom function between calls): the engine had nothing of
                # it to abort, so its later calls ran on the new weights after the earlier ones
                # on the old. The policy is a restart on the new weights: discard the samples.
                aborted = len(samples)
            if aborted:
                m.REQUESTS.labels("aborted").inc()
                reason = "drain" if self._stopping else "weight_update" if updated else "pause"
                m.ABORTED.labels(reason).inc(aborted)
                attempts += 1
                if self._stopping or attempts > MAX_REGENERATIONS:
                    return None
                m.PROMPTS.labels(item.kind, "requeued").inc()
                continue
            m.REQUESTS.labels("ok").inc()
            self._gen_errors = 0
            tokens = sum(
                len(s.token_ids) if s.loss_mask is None else int(sum(s.loss_mask)) for s in samples
            )
            self.generated_tokens += tokens
            m.GENERATED_TOKENS.labels(item.kind).inc(tokens)
            engine_queue = min((s.engine_queue_seconds for s in samples), default=0.0)
            queued = started - leased_at + engine_queue
            generate = max(0.0, time.monotonic() - started - engine_queue)
            m.QUEUE_SECONDS.observe(queued)
            m.GENERATE_SECONDS.observe(generate)
            meta: dict[str, Any] = {"replica": self.replica_id}
            if item.delivery_count > 1:
                meta["delivery_count"] = item.delivery_count
            if gen.aborted_by:
                meta["weight_update"] = "aborted_and_regenerated"
                meta["aborted_by_versions"] = gen.aborted_by
            elif gen.finished_on_old:
                meta["weight_update"] = "finished_on_old_weights"
                meta["updated_to_versions"] = gen.finished_on_old
            texts = [self.ctx.decode(s.token_ids) for s in samples]
            return _Done(item, samples, queued, generate, meta, texts)

    async def _score(self, done: Sequence[_Done]) -> tuple[dict[str, rpb.SampleScore], float]:
        request = rpb.ScoreRequest()
        for d in done:
            for j, s in enumerate(d.samples):
                request.samples.append(
                    rpb.Sample(
                        sample_id=f"{d.item.lease_id}#{j}",
                        prompt=d.item.text,
                        response=d.texts[j],
                        response_token_ids=encode_array(np.asarray(s.token_ids, dtype=np.int32)),
                        answer=d.item.answer,
                        metadata_json=json.dumps(d.item.metadata) if d.item.metadata else "",
                        finish_reason=FINISH_REASONS[s.finish_reason],
                    )
                )
        started = time.monotonic()
        answer = await self._call(self.reward.Score, request, "Score")
        seconds = time.monotonic() - started
        m.SCORE_SECONDS.observe(seconds)
        scores = {s.sample_id: s for s in answer.scores}
        missing = [s.sample_id for s in request.samples if s.sample_id not in scores]
        if missing:
            raise CallFailed(
                "Score", grpc.StatusCode.DATA_LOSS, f"no score for {len(missing)} samples"
            )
        return scores, seconds

    def _group(
        self, d: _Done, scores: dict[str, rpb.SampleScore], score_seconds: float, kind: str
    ) -> Group:
        trajectories = []
        for j, s in enumerate(d.samples):
            score = scores[f"{d.item.lease_id}#{j}"]
            metadata = {**d.metadata, **s.metadata}
            if score.error:
                metadata["reward_error"] = score.error
            trajectories.append(
                Trajectory(
                    prompt_token_ids=np.asarray(d.item.token_ids, dtype=np.int32),
                    response_token_ids=np.asarray(s.token_ids, dtype=np.int32),
                    rollout_logprobs=np.asarray(s.logprobs, dtype=np.float32),
                    loss_mask=None if s.loss_mask is None else np.asarray(s.loss_mask, np.uint8),
                    prompt_id=d.item.prompt_id,
                    epoch=d.item.epoch,
                    sample_index=j,
                    reward=score.reward,
                    reward_breakdown=dict(score.breakdown),
                    finish_reason=s.finish_reason,
                    policy_version_start=s.version_start or 0,  # set in _generate_group
                    policy_version_end=s.version_end or 0,
                    queued_seconds=d.queued_seconds,
                    generate_seconds=d.generate_seconds,
                    score_seconds=score_seconds,
                    finished_unix=time.time(),
                    metadata=metadata,
                    response_text=d.texts[j],
                )
            )
        if self.rc.mode == "rejection_sampling":
            threshold = self.rc.rejection_threshold
            trajectories = [t for t in trajectories if t.reward >= threshold]
        return Group(prompt_id=d.item.prompt_id, epoch=d.item.epoch, trajectories=trajectories)

    async def _put(self, kind: str, groups: list[Group], lease_ids: list[str]) -> None:
        put_kind = "sft" if self.rc.mode == "rejection_sampling" else kind
        # Encoded group by group (kuberl.common.buffer_client): a request message holding the
        # groups would copy each one into it, and encoding that in one piece is slow.
        head = bpb.PutTrajectoriesRequest(
            consumer=self.replica_id, kind=KINDS[put_kind], lease_ids=lease_ids
        )
        request = encode_put(head, (g.to_proto() for g in groups))
        try:
            answer = await self._call(self.buffer.PutTrajectories, request, "PutTrajectories")
            results = [r.status == bpb.PUT_STATUS_ACCEPTED for r in answer.results]
        except CallFailed as exc:
            if exc.code is grpc.StatusCode.ALREADY_EXISTS and len(groups) == 1:
                results = [False]  # accepted by an earlier attempt whose answer was lost
            elif exc.code is grpc.StatusCode.INVALID_ARGUMENT and len(groups) > 1:
                for g, lid in zip(groups, lease_ids, strict=True):  # find the bad group(s)
                    await self._put(kind, [g], [lid])
                return
            else:
                m.GROUPS_PUT.labels(put_kind, "rejected").inc(len(groups))
                m.FAILURES.labels("put").inc()
                log.error("batch.put_failed", groups=len(groups), error=str(exc))
                return  # the caller releases the prompts
        for accepted, lid in zip(results, lease_ids, strict=True):
            m.GROUPS_PUT.labels(put_kind, "accepted" if accepted else "duplicate").inc()
            self._inflight.pop(lid, None)
        self.groups_put += len(groups)
        self.prompts_put += len(groups)
        m.PROMPTS.labels(kind, "put").inc(len(groups))
        m.IN_FLIGHT.set(len(self._inflight))

    async def _release(self, kind: str, lease_ids: Iterable[str]) -> None:
        ids = list(lease_ids)
        request = bpb.ReleasePromptsRequest(
            lease_ids=ids, consumer=self.replica_id, kind=KINDS[kind]
        )
        released = True
        try:
            await self._call(self.buffer.ReleasePrompts, request, "ReleasePrompts")
        except CallFailed as exc:
            # Unreachable buffer (a partition): the leases stay with this replica at the buffer,
            # which re-delivers them after its lease timeout. Not counted as released.
            released = False
            m.FAILURES.labels("release").inc()
            log.error("prompts.release_failed", prompts=len(ids), error=str(exc))
        for lid in ids:
            self._inflight.pop(lid, None)
        m.IN_FLIGHT.set(len(self._inflight))
        if not released:
            m.PROMPTS.labels(kind, "abandoned").inc(len(ids))
            log.warning("prompts.abandoned", prompts=len(ids), kind=kind)
            return
        self.prompts_released += len(ids)
        m.PROMPTS.labels(kind, "released").inc(len(ids))
        log.info("prompts.released", prompts=len(ids), kind=kind)

    async def _call(self, method: Callable[..., Awaitable[Any]], request: Any, name: str) -> Any:
        """A unary call with retries of transient errors; CallFailed when it gives up."""
        for attempt in range(1, self.rc.max_attempts + 1):
            try:
                return await method(request, timeout=self.rc.rpc_timeout_seconds)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code not in TRANSIENT or attempt == self.rc.max_attempts:
                    raise CallFailed(name, code, exc.details() or "") from None
                m.RPC_RETRIES.labels(name, code.name).inc()
                delay = self._backoff(attempt)
                if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    delay = retry_after(exc, delay)
                log.warning("rpc.retry", method=name, code=code.name, attempt=attempt, delay=delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    # -- control ------------------------------------------------------------------------------

    @property
    def prompts_in_flight(self) -> int:
        return len(self._inflight)

    async def pause(self, abort_in_flight: bool) -> int:
        """Stop leasing and generating; in-flight generations are aborted (and regenerated
        after `resume`) or held in place."""
        self._paused = True
        self._lease_gate.clear()
        self.state = "paused"
        m.PAUSES.labels("rpc").inc()
        aborted = await self.engine.pause("abort" if abort_in_flight else "in_place")
        log.info("replica.paused", abort=abort_in_flight, aborted=aborted)
        return aborted

    async def resume(self) -> None:
        self._paused = False
        if not self._loading:
            await self.engine.resume()
        if not self._update_lock.locked() and not self._stopping:
            self.state = "running"
        self._lease_gate.set()
        log.info("replica.resumed")

    async def _await_trainable_weights(self, policy_version: int) -> None:
        """Hold a training batch while the engine's weights are too old for its groups to be
        trained: the trainer is at `policy_version` or later when it takes them, and drops a
        group older than `trainer.max_staleness` versions (never asking for a version newer
        than the last one `trainer.publish_every` lets the trainer publish). Waits for the
        weight update up to `rollout.version_wait_seconds`, then generates anyway (weights that
        never come must not stall the replica: the buffer drops and re-queues what turns out
        stale)."""
        tc = self.config.trainer
        timeout = self.rc.version_wait_seconds
        if tc.max_staleness < 0 or timeout <= 0 or not (self.rc.weight_sync and tc.publish_weights):
            return  # no bound, or no update is coming
        need = oldest_trainable_version(policy_version, tc.max_staleness, tc.publish_every)
        if self.engine.version >= need:
            return
        started = time.monotonic()
        try:
            async with self._version_changed:
                await asyncio.wait_for(
                    self._version_changed.wait_for(
                        lambda: self.engine.version >= need or self._stopping
                    ),
                    timeout,
                )
            outcome = "loaded"
        except TimeoutError:
            outcome = "timed_out"
        m.VERSION_WAITS.labels(outcome).inc()
        log.debug(
            "batch.waited_for_weights",
            need=need,
            engine=self.engine.version,
            outcome=outcome,
            seconds=round(time.monotonic() - started, 3),
        )

    async def apply_weight_update(self, version: int, load: Callable[[], Awaitable[Any]]) -> None:
        """Pause generation, run `load` (which loads `version` into the engine), resume."""
        async with self._update_lock:
            started = time.monotonic()
            previous = self.state
            self.state = "updating_weights"
            self._gen_gate.clear()
            m.PAUSES.labels("weight_update").inc()
            try:
                if self.rc.on_weight_update == "abort":
                    for gen in self._generating:
                        gen.aborted_by.append(version)
                    self._loading = True
                    await self.engine.pause("abort")
                else:
                    for gen in self._generating:
                        gen.finished_on_old.append(version)
                    # A replica paused in place (Pause RPC) holds these until it is resumed.
                    async with self._gen_changed:
                        await self._gen_changed.wait_for(lambda: not self._generating)
                    self._loading = True
                    await self.engine.pause("in_place")
                await load()
            finally:
                self._loading = False
                if not self._paused:
                    await self._resume_engine("weight_update")
                self._gen_gate.set()
                # A Pause, Resume or drain may have come while the update ran.
                if self._stopping:
                    self.state = "draining"
                elif self._paused:
                    self.state = "paused"
                elif previous in ("updating_weights", "paused"):
                    self.state = "running"
                else:
                    self.state = previous
            m.ENGINE_VERSION.set(self.engine.version)
            async with self._version_changed:
                self._version_changed.notify_all()
            m.WEIGHT_UPDATE_SECONDS.observe(time.monotonic() - started)
            log.info(
                "replica.weights_updated",
                version=version,
                policy=self.rc.on_weight_update,
                seconds=round(time.monotonic() - started, 3),
            )

    async def _resume_engine(self, after: str) -> None:
        """Resume the engine; a failure (e.g. the SGLang server restarting, after the engine's
        own retries) is logged and counted, and never keeps the generation gate shut: the
        generations then meet the engine's own errors, which fail and release their groups."""
        try:
            await asyncio.wait_for(self.engine.resume(), CONTROL_SECONDS)
        except Exception as exc:
            m.FAILURES.labels("resume").inc()
            log.error("engine.resume_failed", after=after, error=f"{type(exc).__name__}: {exc}")

    async def drain(self, timeout: float | None = None) -> tuple[int, int]:
        """Stop leasing; let in-flight batches finish within timeout, then abort generation
        and release what is left. Returns (prompts finished, prompts released) meanwhile."""
        timeout = self.rc.drain_seconds if timeout is None else timeout
        put0, released0 = self.prompts_put, self.prompts_released
        self._stopping = True
        self.state = "draining"
        self._stop.set()
        self._lease_gate.set()
        async with self._version_changed:  # a batch waiting for weights goes on now
            self._version_changed.notify_all()
        log.info("replica.draining", batches=len(self._batches), timeout=timeout)
        # A lease in flight either becomes a batch or is released before run() returns.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._run_finished.wait(), self.rc.rpc_timeout_seconds)
        if self._batches:
            await asyncio.wait(set(self._batches), timeout=timeout)
        if self._batches:
            self._aborting = True
            self._gen_gate.set()
            # Aborted requests come back at once; if the engine could not abort (it is down),
            # nothing comes back, and the batches are cancelled now.
            wait = max(10.0, self.rc.rpc_timeout_seconds)
            try:
                await asyncio.wait_for(self.engine.abort_all(), CONTROL_SECONDS)
            except Exception as exc:
                wait = 0.0
                m.FAILURES.labels("abort").inc()
                log.error("engine.abort_failed", error=f"{type(exc).__name__}: {exc}")
            if self._paused and wait:
                await self._resume_engine("drain")  # let aborted requests come back
            pending = set(self._batches)
            if wait:
                _, pending = await asyncio.wait(pending, timeout=wait)
            for task in pending:  # stuck in a call: cancelling releases its prompts
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=self.rc.rpc_timeout_seconds)
        finished, released = self.prompts_put - put0, self.prompts_released - released0
        log.info("replica.drained", finished=finished, released=released)
        return finished, released


class _Wait(Exception):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
