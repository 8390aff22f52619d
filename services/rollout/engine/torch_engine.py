"""The `torch` engine: an in-process HF transformers causal LM (local mode, CI, one-GPU tests).

`create_engine` builds it for `rollout.engine.kind: torch`. One worker thread batches the
queued rows (one per sample), prefills once and decodes with a `DynamicCache`, sampling each row
with its own parameters and recording the logprob of the sampled token; finished rows are
pruned from the cache. It is static batching with pruning, not continuous batching: a new
request waits for the current batch. Weights arrive in this process from
`kuberl.common.weights.EngineClient` (`load_weights`), so the engine joins no broadcast group
itself. With `model.lora` the model carries the job's adapters (`kuberl.common.lora.inject`, as
the trainer's) and a version is adapter tensors only, applied in place over the unchanged base.
Its behaviour and how it is tested: docs/rollout.md, "torch".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kuberl.common import lora, metrics
from kuberl.common.config import LoraConfig
from kuberl.common.logs import get_logger
from kuberl.rollout.engine.base import (
    Completion,
    Engine,
    EngineError,
    EngineRejected,
    EngineStatus,
    FinishReason,
    NamedTensors,
    PauseMode,
    SamplingParams,
)

log = get_logger(__name__)

_BATCH_ROWS = metrics.histogram(
    "kuberl_rollout_torch_batch_rows",
    "Rows (samples) in one batch of the torch engine",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return (token ids [B], their logprobs [B]).

    logits [B, V] float32; temperature, top_p [B] float32; top_k [B] int64 (0 = off). Rows with
    temperature 0 are greedy. Logprobs are log_softmax(logits / T) at the chosen token (T = 1 for
    greedy rows), i.e. before top-k / top-p truncation, as SGLang returns them.
    """
    greedy = temperature <= 0  # [B]
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)  # [B]
    logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)  # [B, V]
    tokens = logits.argmax(dim=-1)  # [B]
    if not bool(greedy.all()):
        if bool((top_k > 0).any()) or bool((top_p < 1).any()):
            sorted_lp, order = logprobs.sort(dim=-1, descending=True)  # [B, V] each
            probs = sorted_lp.exp()  # [B, V]
            ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]  # [1, V]
            keep = (top_k[:, None] == 0) | (ranks < top_k[:, None])  # [B, V]
            mass_before = probs.cumsum(dim=-1) - probs  # [B, V] mass of strictly likelier tokens
            keep &= (top_p[:, None] >= 1) | (mass_before < top_p[:, None])  # rank 0 always kept
            pick = torch.multinomial(probs * keep, 1, generator=generator)  # [B, 1] rank
            sampled = order.gather(1, pick)[:, 0]  # [B]
        else:
            sampled = torch.multinomial(logprobs.exp(), 1, generator=generator)[:, 0]  # [B]
        tokens = torch.where(greedy, tokens, sampled)  # [B]
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def load_state(
    state: Mapping[str, torch.Tensor],
    items: Sequence[tuple[str, torch.Tensor]],
    *,
    borrow: bool,
    borrowed: bool,
) -> bool:
    """Put `items` into the model tensors `state` (a `state_dict(keep_vars=True)`); returns
    whether any of them now points at memory lent by the caller.

    `borrow`: the caller's tensors stay valid until the next load, so a tensor of the target's
    dtype and device is taken as is (the parameter is pointed at it; no copy). Others are
    copied. `borrowed`: whether the previous load lent memory; a copy then goes into fresh
    storage rather than into the parameter's current storage, which belongs to the lender and
    is about to be reused for a later version."""
    lent = False
    for name, tensor in items:
        target = state[name]
        if borrow and tensor.dtype == target.dtype and tensor.device == target.device:
            target.data = tensor
            lent = True
        elif borrowed:
            target.data = tensor.to(device=target.device, dtype=target.dtype, copy=True)
        else:
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
    return lent


@dataclass(eq=False)
class _Request:
    rid: str
    num_prompts: int
    n: int
    future: concurrent.futures.Future[list[list[Completion]]]
    submitted: float
    results: dict[tuple[int, int], Completion] = field(default_factory=dict)

    def done(self) -> bool:
        return len(self.results) == self.num_prompts * self.n


@dataclass(eq=False)
class _Row:
    request: _Request
    prompt_index: int
    sample_index: int
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version_start: int = -1
    started: float = 0.0
    aborted: bool = False
    done: bool = False


class TorchEngine(Engine):
    """Generates with a transformers causal LM in this process (CPU or one GPU).

    Rows stop on EOS, a stop token id, a stop string, `max_new_tokens` or the context length.
    Pauses, aborts and weight loads happen between decode steps: forward passes and weight
    copies hold one lock, so a load never sees half a step. `pause("in_place")` parks the
    batch, which continues after `resume()` (on weights loaded meanwhile, as `version_end`
    records); `pause("abort")` ends every row with finish reason "abort".
    """

    kind = "torch"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch_size: int = 64,
        seed: int = 0,
        version: int = 0,
        batch_wait_seconds: float = 0.005,
        adapters: LoraConfig | None = None,
    ) -> None:
        #: `model.lora`: the model's adapters are what versions load (`inject` them first).
        self.adapters = adapters
        self.model = model.eval()
        self.batch_wait_seconds = batch_wait_seconds
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.pad_token_id = (
            tokenizer.pad_token_id
            if tokenizer is not None and tokenizer.pad_token_id is not None
            else (min(self.eos_token_ids) if self.eos_token_ids else 0)
        )
        self._version = version
        #: Whether parameters point at tensors lent by the last `load_weights(borrow=True)`.
        self._borrowed = False
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._cv = threading.Condition()
        self._queue: deque[_Row] = deque()
        self._running: list[_Row] = []
        self._paused = False
        self._parked = True
        self._closed = False
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 64,
        seed: int = 0,
        attn_implementation: str = "sdpa",
        version: int = 0,
        batch_wait_seconds: float = 0.005,
        adapters: LoraConfig | None = None,
    ) -> TorchEngine:
        """Load a local HF model folder (weights + tokenizer); nothing is downloaded. With
        `adapters` (`model.lora`) the job's LoRA adapters are injected over it."""
        from transformers import AutoModelForCausalLM

        from kuberl.common.modelbuild import load_tokenizer

        tokenizer = load_tokenizer(path)
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(path),
            dtype=getattr(torch, dtype),
            attn_implementation=attn_implementation,
            local_files_only=True,
        )
        if adapters is not None:
            lora.inject(model, adapters)
        return cls(
            model.to(device),
            tokenizer,
            max_batch_size=max_batch_size,
            seed=seed,
            version=version,
            batch_wait_seconds=batch_wait_seconds,
            adapters=adapters,
        )

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="torch-engine", daemon=True)
            self._thread.start()

    async def close(self) -> None:
        with self._cv:
            self._closed = True
            self._abort_locked()
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    async def health(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    async def status(self) -> EngineStatus:
        with self._cv:
            running = len({id(r.request) for r in self._running if not r.done})
            queued = len({id(r.request) for r in self._queue})
            return EngineStatus(self.kind, self._version, self._paused, running, queued)

    # -- generation ------------------------------------------------------------------------------

    async def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        if not prompts:
            return []
        request = _Request(
            rid=f"torch-{next(self._ids)}",
            num_prompts=len(prompts),
            n=params.n,
            future=concurrent.futures.Future(),
            submitted=time.perf_counter(),
        )
        rows = []
        for i, prompt in enumerate(prompts):
            ids = self._check_prompt(list(prompt), i)
            rows += [_Row(request, i, s, ids, params) for s in range(params.n)]
        if self._thread is None:
            await self.start()
        with self._cv:
            if self._closed:
                raise EngineError("the torch engine is closed")
            self._queue.extend(rows)
            self._cv.notify_all()
        return await asyncio.wrap_future(request.future)

    def _check_prompt(self, ids: list[int], index: int) -> list[int]:
        if not ids:
            raise EngineRejected(f"prompt {index} is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineRejected(
                f"prompt {index} has token ids outside the vocabulary [0, {self.vocab_size}): "
                f"{bad[:5]}"
            )
        if self.max_positions and len(ids) >= self.max_positions:
            raise EngineRejected(
                f"prompt {index} has {len(ids)} tokens; the model's context is {self.max_positions}"
            )
        return ids

    # -- pause / abort ---------------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "in_place") -> int:
        if mode not in ("abort", "in_place"):
            raise ValueError(f"pause mode must be 'abort' or 'in_place', got {mode!r}")
        with self._cv:
            self._paused = True
            aborted = self._abort_locked() if mode == "abort" else 0
            self._cv.notify_all()
        await asyncio.to_thread(self._wait_parked)
        return aborted

    async def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    async def abort_all(self) -> int:
        with self._cv:
            aborted = self._abort_locked()
            self._cv.notify_all()
        return aborted

    def _abort_locked(self) -> int:
        """Abort queued rows now and mark running ones (the worker ends them at its next step)."""
        requests = {id(r.request) for r in self._queue}
        requests |= {id(r.request) for r in self._running if not r.done}
        while self._queue:
            self._finish(self._queue.popleft(), "abort", None)
        for row in self._running:
            row.aborted = True
        return len(requests)

    def _wait_parked(self) -> None:
        with self._cv:
            while not self._parked and not self._closed:
                self._cv.wait(0.5)

    # -- weights ---------------------------------------------------------------------------------

    async def load_weights(
        self, named_tensors: NamedTensors, version: int, *, borrow: bool = False
    ) -> int:
        """`borrow`: the caller's tensors stay valid until the next load (the weight client's
        double buffer, or weight-sync's shared-memory file), so matching parameters point at
        them and the load copies nothing (`load_state`)."""
        return await asyncio.to_thread(self._load_sync, named_tensors, version, borrow)

    def _load_sync(self, named_tensors: NamedTensors, version: int, borrow: bool = False) -> int:
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if version < self._version:
            raise EngineRejected(
                f"weights of version {version} are older than the loaded version {self._version}"
            )
        if self.adapters is not None:
            base = [name for name, _ in items if not lora.is_adapter_tensor(name)]
            if base:
                raise EngineRejected(
                    f"cannot load version {version}: this engine applies model.lora's "
                    "adapters over its base model and loads adapter tensors only (lora_A, "
                    f"lora_B), but the version has {len(base)} others, e.g. {base[:3]}; "
                    "publish from a trainer with the same model.lora"
                )
        state = self.model.state_dict(keep_vars=True)
        unknown = [name for name, _ in items if name not in state]
        wrong = [
            f"{name} {tuple(t.shape)} (expected {tuple(state[name].shape)})"
            for name, t in items
            if name in state and tuple(t.shape) != tuple(state[name].shape)
        ]
        if unknown or wrong:
            parts = []
            if unknown:
                parts.append(f"unknown tensor names {unknown[:5]}")
            if wrong:
                parts.append(f"wrong shapes {wrong[:5]}")
            raise EngineRejected(f"cannot load version {version}: " + "; ".join(parts))
        started = time.perf_counter()
        with self._step_lock, torch.no_grad():
            self._borrowed = load_state(state, items, borrow=borrow, borrowed=self._borrowed)
            self._version = version
        log.info(
            "engine.weights_loaded",
            version=version,
            tensors=len(items),
            borrowed=self._borrowed,
            seconds=round(time.perf_counter() - started, 4),
        )
        return len(items)

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """An HF folder's safetensors, or with `model.lora` an adapter folder PEFT saved."""
        from safetensors.torch import load_file

        if self.adapters is not None and (Path(path) / lora.ADAPTER_CONFIG_FILE).exists():
            adapter = await asyncio.to_thread(lora.load_adapter, Path(path))
            await self.load_weights(adapter, version)
            return
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise EngineRejected(f"no *.safetensors file in {path}")
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(await asyncio.to_thread(load_file, str(file)))
        await self.load_weights(tensors, version)

    # -- the worker thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._parked = True
                self._cv.notify_all()
                while not self._closed and (self._paused or not self._queue):
                    self._cv.wait()
                if self._closed:
                    return
                # Requests arrive one prompt or one turn at a time; a few milliseconds of
                # waiting lets concurrent ones share the batch.
                deadline = time.monotonic() + self.batch_wait_seconds
                while (
                    len(self._queue) < self.max_batch_size
                    and not self._closed
                    and (left := deadline - time.monotonic()) > 0
                ):
                    self._cv.wait(left)
                if self._closed:
                    return
                if self._paused or not self._queue:
                    continue
                rows: list[_Row] = []
                while self._queue and len(rows) < self.max_batch_size:
                    rows.append(self._queue.popleft())
                self._running = rows
                self._parked = False
            try:
                with torch.inference_mode():
                    self._run_batch(rows)
            except Exception as exc:  # a bug or OOM must fail the callers, not hang them
                log.exception("engine.batch_failed", rows=len(rows))
                error = EngineError(f"torch engine batch failed: {type(exc).__name__}: {exc}")
                with self._cv:
                    for request in {id(r.request): r.request for r in rows}.values():
                        if not request.future.done():
                            request.future.set_exception(error)
            finally:
                with self._cv:
                    self._running = []

    def _forward(self, **inputs: Any) -> torch.Tensor:
        with self._step_lock:
            out = self.model(**inputs, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()  # [B, V]

    def _run_batch(self, rows: list[_Row]) -> None:
        from transformers import DynamicCache

        _BATCH_ROWS.observe(len(rows))
        started = time.perf_counter()
        version = self._version
        for row in rows:
            row.version_start, row.started = version, started
        dev = self.device
        width = max(len(r.prompt) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)  # [B, P]
        attention = torch.zeros((len(rows), width), dtype=torch.long)  # [B, P]
        for i, row in enumerate(rows):
            input_ids[i, width - len(row.prompt) :] = torch.tensor(row.prompt)
            attention[i, width - len(row.prompt) :] = 1
        input_ids, attention = input_ids.to(dev), attention.to(dev)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        temperature = torch.tensor([r.params.temperature for r in rows], device=dev)  # [B]
        top_p = torch.tensor([r.params.top_p for r in rows], device=dev)  # [B]
        top_k = torch.tensor([r.params.top_k for r in rows], device=dev, dtype=torch.long)  # [B]
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
        )
        active = list(rows)  # batch row i of the tensors is active[i]
        while True:
            if not self._checkpoint(active):
                return
            tokens, logprobs = sample_tokens(logits, temperature, top_p, top_k, self._generator)
            token_list, logprob_list = tokens.tolist(), logprobs.tolist()
            for i, row in enumerate(active):
                if not row.done:
                    row.tokens.append(token_list[i])
                    row.logprobs.append(logprob_list[i])
                    self._check_stop(row)
            live = [i for i, row in enumerate(active) if not row.done]
            if not live:
                return
            last_pos = positions[:, -1:] + 1  # [B, 1]
            if len(live) <= len(active) // 2:  # drop finished rows from the cache
                index = torch.tensor(live, device=dev)
                cache.batch_select_indices(index)
                attention, last_pos, tokens = attention[index], last_pos[index], tokens[index]
                temperature, top_p, top_k = temperature[index], top_p[index], top_k[index]
                active = [active[i] for i in live]
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            positions = last_pos
            logits = self._forward(
                input_ids=tokens[:, None],
                attention_mask=attention,
                position_ids=positions,
                past_key_values=cache,
            )

    def _checkpoint(self, active: list[_Row]) -> bool:
        """Between two steps: end aborted rows, park while paused; False when none is left."""
        with self._cv:
            while True:
                for row in active:
                    if row.aborted and not row.done:
                        self._finish(row, "abort", None)
                if all(row.done for row in active):
                    return False
                if not self._paused or self._closed:
                    self._parked = False
                    return True
                self._parked = True
                self._cv.notify_all()
                self._cv.wait()

    def _check_stop(self, row: _Row) -> None:
        token = row.tokens[-1]
        params = row.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            self._finish(row, "stop", token)
            return
        if params.stop and self.tokenizer is not None:
            window = max(len(s) for s in params.stop) + 1
            tail = self.tokenizer.decode(row.tokens[-window:], skip_special_tokens=False)
            for stop in params.stop:
                if stop in tail:
                    self._finish(row, "stop", stop)
                    return
        if len(row.tokens) >= params.max_new_tokens or (
            self.max_positions and len(row.prompt) + len(row.tokens) >= self.max_positions
        ):
            self._finish(row, "length", None)

    def _finish(self, row: _Row, reason: FinishReason, matched: int | str | None) -> None:
        with self._cv:
            if row.done:
                return
            row.done = True
            request = row.request
            queued = (row.started or time.perf_counter()) - request.submitted
            request.results[(row.prompt_index, row.sample_index)] = Completion(
                token_ids=row.tokens,
                logprobs=row.logprobs,
                finish_reason=reason,
                version_start=row.version_start if row.version_start >= 0 else self._version,
                version_end=self._version,
                matched_stop=matched,
                rid=f"{request.rid}-{row.prompt_index}-{row.sample_index}",
                engine_queue_seconds=max(0.0, queued),
            )
            if request.done() and not request.future.done():
                request.future.set_result(
                    [
                        [request.results[(p, s)] for s in range(request.n)]
                        for p in range(request.num_prompts)
                    ]
                )


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
