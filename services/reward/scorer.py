"""Scoring a batch: which verifiers score each sample, where they run, and how they combine.

`Scorer` is the reward service minus gRPC; the servicer and `kuberl reward score` both use it.
A sample's combination is the job's `reward.verifiers` (name -> weight), or the sample's own
list: entries `name` (weight from the job's combination, else 1.0) or `name=weight`. Each
verifier runs on its backend (see `kuberl.reward.verifiers`); all samples of a batch and all
their backends run concurrently, bounded by the worker processes, the sandbox slots and the
reward model's batch size.

The reward is sum(weight * score). The breakdown holds each verifier's unweighted score under
its name and its extra numbers as `name/key` (e.g. `code/passed`, `length/tokens`). If any
verifier of a sample fails (raises, times out, returns NaN or a non-number, its worker dies),
the sample's reward is `fallback_reward`, its breakdown keeps the verifiers that did succeed,
and `error` says which failed and why (`gsm8k: timeout: no result after 10s`). A failure never
fails the batch; only bad input (unknown verifier, malformed metadata) does, in the servicer.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kuberl.common import metrics
from kuberl.common.config import BUILTIN_VERIFIERS, JobConfig
from kuberl.common.errors import InvalidArgument
from kuberl.common.logs import get_logger
from kuberl.common.sandbox import FULL_ISOLATION, Sandbox, SandboxError
from kuberl.reward.pool import WorkerPool
from kuberl.reward.sample import RewardSample
from kuberl.reward.verifiers import BUILTINS, Backend, Verdict, VerifierFailure, as_verdict
from kuberl.reward.verifiers import code as code_verifier
from kuberl.reward.verifiers import custom as custom_verifier
from kuberl.reward.verifiers import length as length_verifier
from kuberl.reward.verifiers.reward_model import RewardModel

log = get_logger(__name__)

SCORE_BUCKETS = (-10, -5, -2, -1, -0.75, -0.5, -0.25, 0, 0.25, 0.5, 0.75, 1, 2, 5, 10)

_score = metrics.histogram(
    "kuberl_reward_score", "Unweighted score of each verifier", ["verifier"], SCORE_BUCKETS
)
_combined = metrics.histogram(
    "kuberl_reward_combined_score", "Reward of each sample (weighted sum)", (), SCORE_BUCKETS
)
_seconds = metrics.histogram(
    "kuberl_reward_verifier_seconds", "Time a verifier took on one sample", ["verifier"]
)
_errors = metrics.counter(
    "kuberl_reward_errors_total",
    "Verifier failures that gave a sample the fallback reward, by reason",
    ["verifier", "reason"],
)
_timeouts = metrics.counter(
    "kuberl_reward_timeouts_total", "Verifier calls cut off at the per-sample timeout", ["verifier"]
)
_samples = metrics.counter(
    "kuberl_reward_samples_total", "Samples scored, by outcome (scored, fallback)", ["outcome"]
)
_sandbox_tests = metrics.counter(
    "kuberl_reward_sandbox_tests_total", "Code tests run in the sandbox, by outcome", ["status"]
)
_isolation = metrics.gauge(
    "kuberl_reward_sandbox_isolated",
    "1 where the code sandbox has this isolation (network, files, uid), else 0",
    ["aspect"],
)
_sandbox_uids = metrics.gauge(
    "kuberl_reward_sandbox_uid",
    "The dedicated uid each sandbox slot runs programs as (root only; see reward.sandbox.uid_base)",
    ["slot"],
)

Outcome = Verdict | VerifierFailure


@dataclass
class ScoreResult:
    """The score of one sample, as the gRPC `SampleScore` carries it."""

    sample_id: str
    reward: float
    breakdown: dict[str, float] = field(default_factory=dict)
    error: str = ""
    details: str = ""


@dataclass(frozen=True)
class VerifierInfo:
    name: str
    description: str
    weight: float
    backend: Backend


class Scorer:
    """Scores batches of samples with the job's verifiers; `start()` before, `stop()` after."""

    def __init__(self, job: JobConfig) -> None:
        self.job = job
        self.config = job.reward
        self.pool = WorkerPool(self.config.workers, job.model_dump_json(), self.timeout)
        self.sandbox = Sandbox(self.config.sandbox, setting="reward.sandbox")
        self.reward_model = (
            RewardModel(self.config.reward_model) if self.config.reward_model else None
        )
        self._async: dict[str, Callable[..., Awaitable[Any]]] = {}
        self._rm_turn = asyncio.Lock()
        self._backends: dict[str, Backend] = {
            name: v.backend for name, v in BUILTINS.items() if name != "rm" or self.reward_model
        }
        # Custom functions are imported here too (not only in the workers) so that a wrong
        # module:function fails at start and async ones can run on this event loop.
        for name, spec in self.config.custom.items():
            fn = custom_verifier.load(name, spec)
            if custom_verifier.is_async(fn):
                self._async[name] = fn
                self._backends[name] = "async"
            else:
                self._backends[name] = "pool"
        self.length_soft_limit = (
            self.config.length_soft_limit
            or length_verifier.default_soft_limit(
                job.rollout.sampling.max_new_tokens, self.config.length_penalty_buffer
            )
        )

    @property
    def timeout(self) -> float:
        return self.config.timeout_seconds

    async def start(self) -> None:
        """Start the workers, probe the sandbox, load the reward model."""
        await self.pool.start()
        await self._probe_sandbox()
        if self.reward_model is not None:
            await asyncio.to_thread(self.reward_model.load)

    async def _probe_sandbox(self) -> None:
        """Check the sandbox works and how isolated it is. A job that does not use `code` in
        its combination still starts when it does not work (samples asking for it are then
        refused as an unknown verifier)."""
        needed = "code" in self.config.verifiers or self.config.sandbox.require_isolation
        try:
            isolation = await self.sandbox.probe()
        except Exception as exc:
            if needed:
                raise
            del self._backends["code"]
            log.warning("sandbox.unavailable", error=str(exc)[:500])
            return
        for aspect, good in FULL_ISOLATION.items():
            _isolation.labels(aspect).set(1.0 if isolation.get(aspect) == good else 0.0)
        for slot, uid in enumerate(self.sandbox.uids):
            _sandbox_uids.labels(str(slot)).set(uid)
        if self.sandbox.fully_isolated:
            log.info("sandbox.isolation", **isolation)
        elif self.config.sandbox.require_isolation:
            raise RuntimeError(
                f"reward.sandbox.require_isolation is set but the code sandbox only gets "
                f"{isolation} here (needs root, network and mount namespaces)"
            )
        else:
            log.warning("sandbox.weak_isolation", **isolation)

    async def stop(self) -> None:
        await self.pool.stop()

    def verifiers(self) -> list[VerifierInfo]:
        """Every verifier this service can run, with its weight in the job's combination."""
        infos = [
            VerifierInfo(name, BUILTINS[name].description, self.config.verifiers.get(name, 0.0), b)
            for name, b in self._backends.items()
            if name in BUILTIN_VERIFIERS
        ]
        for name, spec in self.config.custom.items():
            infos.append(
                VerifierInfo(
                    name,
                    spec.description or f"custom: {spec.function}",
                    self.config.verifiers.get(name, 0.0),
                    self._backends.get(name, "pool"),
                )
            )
        return infos

    def combination(self, requested: Sequence[str], sample_id: str = "") -> dict[str, float]:
        """The sample's verifiers and weights; InvalidArgument names what is wrong."""
        if not requested:
            return dict(self.config.verifiers)
        where = f"sample {sample_id!r}: " if sample_id else ""
        combo: dict[str, float] = {}
        for entry in requested:
            name, sep, weight_text = entry.partition("=")
            name = name.strip()
            if name not in self._backends:
                raise InvalidArgument(
                    f"{where}unknown verifier {name!r}; this service has "
                    f"{', '.join(sorted(self._backends))}"
                )
            weight = self.config.verifiers.get(name, 1.0)
            if sep:
                try:
                    weight = float(weight_text)
                except ValueError:
                    weight = math.nan
                if not math.isfinite(weight):
                    raise InvalidArgument(
                        f"{where}verifier entry {entry!r}: the weight must be a "
                        "finite number (name=weight)"
                    )
            combo[name] = weight
        return combo

    async def score(
        self, samples: Sequence[RewardSample], combinations: Sequence[dict[str, float]]
    ) -> list[ScoreResult]:
        """Score every sample with its combination; never raises for a verifier's failure."""
        outcomes: list[dict[str, Outcome]] = [{} for _ in samples]
        jobs: list[Awaitable[None]] = []
        for i, (sample, combo) in enumerate(zip(samples, combinations, strict=True)):
            pooled = [n for n in combo if self._backends[n] == "pool"]
            if pooled:
                jobs.append(self._pooled(sample, pooled, outcomes[i], i))
            for name in combo:
                backend = self._backends[name]
                if backend == "sandbox":
                    # The sandbox times each run from when it gets a slot (with a backstop for a
                    # launcher that does not come back): waiting for a slot is not timed.
                    jobs.append(self._timed(name, self._code(sample), outcomes[i], None))
                elif backend == "async":
                    work = self._custom_async(name, sample)
                    jobs.append(self._timed(name, work, outcomes[i], self.timeout))
                elif backend == "inline":
                    outcomes[i][name] = self._length(sample)
        rm_rows = [i for i, combo in enumerate(combinations) if "rm" in combo]
        if rm_rows:
            jobs.append(self._rm([samples[i] for i in rm_rows], [outcomes[i] for i in rm_rows]))
        await asyncio.gather(*jobs)
        return [
            self._combine(sample, combo, outcome)
            for sample, combo, outcome in zip(samples, combinations, outcomes, strict=True)
        ]

    # -- backends --------------------------------------------------------------------------

    async def _timed(
        self,
        name: str,
        work: Awaitable[Verdict],
        into: dict[str, Outcome],
        limit: float | None,
    ) -> None:
        """`work`'s verdict into `into[name]`, or why not; `limit` None: it keeps its own time."""
        started = time.perf_counter()
        try:
            into[name] = await asyncio.wait_for(work, limit)
        except TimeoutError:
            into[name] = VerifierFailure("timeout", f"no result after {limit or 0:g}s")
        except VerifierFailure as exc:
            into[name] = exc
        except Exception as exc:
            into[name] = VerifierFailure("exception", f"{type(exc).__name__}: {exc}"[:500])
        _seconds.labels(name).observe(time.perf_counter() - started)

    async def _pooled(
        self, sample: RewardSample, names: list[str], into: dict[str, Outcome], rank: int
    ) -> None:
        with_tokens = any(name not in BUILTINS for name in names)
        results = await self.pool.run(names, sample.to_json(with_tokens=with_tokens), rank)
        for name, result in results.items():
            if "error" in result:
                into[name] = VerifierFailure(result["error"], result["message"])
            else:
                into[name] = Verdict(result["score"], result["extras"], result["details"])
                _seconds.labels(name).observe(result["seconds"])

    async def _code(self, sample: RewardSample) -> Verdict:
        tests = code_verifier.parse_tests(sample.metadata)
        program = code_verifier.extract_code(sample.response)
        if not program.strip():
            return Verdict(0.0, {"passed": 0.0, "total": float(len(tests))}, "no code found")
        try:
            run = await self.sandbox.run(program, tests, self.timeout)
        except SandboxError as exc:
            raise VerifierFailure(exc.reason, exc.message) from None
        for result in run.results:
            _sandbox_tests.labels(result["status"]).inc()
        return code_verifier.verdict(run.results)

    async def _custom_async(self, name: str, sample: RewardSample) -> Verdict:
        return as_verdict(await self._async[name](sample), name)

    def _length(self, sample: RewardSample) -> Outcome:
        try:
            return length_verifier.score(
                sample, self.length_soft_limit, self.config.length_penalty_buffer
            )
        except ValueError as exc:
            return VerifierFailure("exception", str(exc))

    async def _rm(self, samples: list[RewardSample], into: list[dict[str, Outcome]]) -> None:
        assert self.reward_model is not None
        size = self.reward_model.config.batch_size
        for start in range(0, len(samples), size):
            chunk = samples[start : start + size]
            pairs = [(s.prompt, s.response) for s in chunk]
            # One batch on the model at a time, and the wait for its turn is not timed. A batch
            # that times out runs on in its thread (threads cannot be stopped) and keeps the
            # turn until it ends, so that the next batch's clock does not run on it either.
            await self._rm_turn.acquire()
            started = time.perf_counter()
            work = asyncio.ensure_future(asyncio.to_thread(self.reward_model.score, pairs))
            work.add_done_callback(self._end_rm_turn)
            outcomes: list[Outcome]
            try:
                scores = await asyncio.wait_for(asyncio.shield(work), self.timeout)
                outcomes = [self._checked(score, "rm") for score in scores]
            except TimeoutError:
                outcomes = [VerifierFailure("timeout", f"batch not scored in {self.timeout:g}s")]
                outcomes *= len(chunk)
            except Exception as exc:
                failure = VerifierFailure("exception", f"{type(exc).__name__}: {exc}"[:500])
                outcomes = [failure] * len(chunk)
            per_sample = (time.perf_counter() - started) / len(chunk)
            for target, outcome in zip(into[start : start + size], outcomes, strict=True):
                target["rm"] = outcome
                _seconds.labels("rm").observe(per_sample)

    def _end_rm_turn(self, work: asyncio.Future[list[float]]) -> None:
        if not work.cancelled():
            work.exception()  # retrieved here: a batch nobody waited for any more may have failed
        self._rm_turn.release()

    @staticmethod
    def _checked(value: float, name: str) -> Outcome:
        try:
            return as_verdict(value, name)
        except VerifierFailure as exc:
            return exc

    # -- combination -----------------------------------------------------------------------

    def _combine(
        self, sample: RewardSample, combo: dict[str, float], outcomes: dict[str, Outcome]
    ) -> ScoreResult:
        result = ScoreResult(sample.sample_id, 0.0)
        errors, notes = [], []
        for name, weight in combo.items():
            outcome = outcomes.get(name) or VerifierFailure("exception", "not scored")
            if isinstance(outcome, VerifierFailure):
                if outcome.reason != "skipped":
                    errors.append(f"{name}: {outcome.reason}: {outcome.message}")
                    _errors.labels(name, outcome.reason).inc()
                    if outcome.reason == "timeout":
                        _timeouts.labels(name).inc()
                continue
            result.breakdown[name] = outcome.score
            for key, value in outcome.extras.items():
                result.breakdown[f"{name}/{key}"] = value
            result.reward += weight * outcome.score
            _score.labels(name).observe(outcome.score)
            if outcome.details:
                notes.append(f"{name}: {outcome.details}")
        if errors:
            result.reward = self.config.fallback_reward
            result.error = "; ".join(errors)
            log.info("sample.fallback", sample_id=sample.sample_id, error=result.error[:300])
        _samples.labels("fallback" if errors else "scored").inc()
        _combined.observe(result.reward)
        result.details = "; ".join(notes)
        return result
