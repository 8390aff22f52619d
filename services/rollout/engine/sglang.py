"""The `sglang` engine: a client of an SGLang server's native HTTP API, pinned to sglang 0.5.23.

The rollout replica drives through it a server beside it (the SGLang container of the rollout
pod, or `sglang.launch_server` started here when `launch` is set): generation, pause / abort, and
weight updates from disk, by NCCL broadcast or by CUDA IPC, or for a LoRA job (`model.lora`) each
version as a LoRA adapter over the unchanged base model. Every request is one route of 0.5.23's
`http_server.py` with a body of its `io_struct.py` request class, which
`tests/contract/test_sglang_contract.py` checks against the installed package; behaviour is
tested against `tests/integration/sglang_standin.py`, as no live SGLang runs where kuberl is
developed. The routes, call sequences and the 0.5.23 facts they rest on: docs/rollout.md, "sglang".
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from kuberl.common.config import LoraConfig, SGLangEngineConfig
from kuberl.common.logs import get_logger
from kuberl.rollout.engine.base import (
    Completion,
    Engine,
    EngineError,
    EngineRejected,
    EngineStatus,
    EngineTimeout,
    EngineUnavailable,
    FinishReason,
    PauseMode,
    SamplingParams,
)

log = get_logger(__name__)

SGLANG_VERSION = "0.5.23"
# SGLang's "no top-k" (TOP_K_ALL in sglang/srt/sampling/sampling_params.py).
TOP_K_ALL = 1 << 30
_RETRY_STATUS = {429, 500, 502, 503, 504}
#: Adapters one running batch may mix: the version being served and the one before it, whose
#: last requests may still run (SGLang counts the base model as one when a request has none).
LORA_ADAPTERS_PER_BATCH = 2


def sampling_params_body(params: SamplingParams) -> dict[str, Any]:
    """SGLang's `sampling_params` for our SamplingParams (no_stop_trim keeps stop text in
    `text`; `output_ids` always hold every generated token)."""
    body: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else TOP_K_ALL,
        "max_new_tokens": params.max_new_tokens,
        "n": params.n,
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if params.stop:
        body["stop"] = list(params.stop)
    if params.stop_token_ids:
        if params.ignore_eos:
            # SGLang (0.5.23, `_check_token_based_finish`) skips every token stop, stop ids
            # included, under ignore_eos: the samples would all run to max_new_tokens, where the
            # torch engine stops at the ids.
            raise EngineRejected(
                "ignore_eos with stop_token_ids: SGLang ignores the stop token ids too under "
                "ignore_eos; drop ignore_eos (stop ids still end samples) or the stop ids"
            )
        body["stop_token_ids"] = list(params.stop_token_ids)
    return body


def _with_adapter(body: dict[str, Any], adapter: str | None) -> dict[str, Any]:
    """`body` generating with the LoRA adapter `adapter` (SGLang's `lora_path` holds the name an
    adapter was loaded under, not a path); None: the base model alone."""
    if adapter is not None:
        body["lora_path"] = adapter
    return body


def generate_body(
    prompt: Sequence[int], params: SamplingParams, rid: str, adapter: str | None = None
) -> dict[str, Any]:
    """The JSON body of one `POST /generate` for one sample (`params.n` is 1)."""
    body = {
        "rid": rid,
        "input_ids": list(prompt),
        "sampling_params": sampling_params_body(params),
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    return _with_adapter(body, adapter)


def attempt_rid(rid: str, attempt: int, attempts: int) -> str:
    """The rid of one attempt of a request (`prefix_body` and `sample_rids` derive theirs from
    it). A retry never reuses a rid: SGLang holds one until it sees its request end and refuses
    it meanwhile. Fixed width, so no attempt's rid is a prefix of another's."""
    width = len(str(attempts - 1))
    return f"{rid}-a{attempt:0{width}d}"


def sample_rids(rid: str, n: int) -> list[str]:
    """One rid per sample of a group, none a prefix of another (SGLang's scheduler aborts every
    request whose rid starts with the one named)."""
    width = len(str(n - 1))
    return [f"{rid}-s{j:0{width}d}" for j in range(n)]


def prefix_body(prompt: Sequence[int], rid: str, adapter: str | None = None) -> dict[str, Any]:
    """A prefill-only `POST /generate`: SGLang computes the prompt's KV cache, keeps it in its
    radix cache and generates nothing. What 0.5.23 itself sends before parallel samples
    (`TokenizerManager._handle_batch_request`: a copy of the request with `max_new_tokens = 0`,
    awaited before the samples are sent). Under the samples' adapter: the radix cache keys a
    prefix by adapter too."""
    body = {
        "rid": f"{rid}-prefix",
        "input_ids": list(prompt),
        "sampling_params": {"max_new_tokens": 0},
        "stream": False,
    }
    return _with_adapter(body, adapter)


def group_body(
    prompt: Sequence[int], params: SamplingParams, rids: list[str], adapter: str | None = None
) -> dict[str, Any]:
    """One `POST /generate` for a group: a batch of `len(rids)` copies of the prompt, one sample
    each. Sent after `prefix_body`, every copy finds the prompt in the prefix cache."""
    body = {
        "rid": rids,
        "input_ids": [list(prompt)] * len(rids),
        "sampling_params": sampling_params_body(params.with_(n=1)),
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    return _with_adapter(body, adapter)


def lora_launch_args(lora: LoraConfig) -> list[str]:
    """launch_server flags that let SGLang take the job's adapters at run time: LoRA on, memory
    for adapters of up to the job's rank on its target modules (no adapter is loaded at launch:
    every version, the first included, comes by `/load_lora_adapter`)."""
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(lora.rank),
        "--lora-target-modules",
        *lora.target_modules,
        "--max-loras-per-batch",
        str(LORA_ADAPTERS_PER_BATCH),
    ]


def adapter_name(session: str, version: int) -> str:
    """The name a version's adapter is loaded under: unique per engine session, so a replica
    restarted on the same server never collides with what its predecessor loaded."""
    return f"kuberl-{session}-v{version}"


def load_adapter_body(name: str, folder: Path) -> dict[str, Any]:
    """Body of `POST /load_lora_adapter`: the adapter in PEFT's saved format, at a path the
    server reads (absolute: the server resolves a relative one against its own directory)."""
    return {"lora_name": name, "lora_path": str(folder.absolute())}


def unload_adapter_body(name: str) -> dict[str, Any]:
    """Body of `POST /unload_lora_adapter`."""
    return {"lora_name": name}


def launch_command(
    config: SGLangEngineConfig,
    model_path: str,
    host: str,
    port: int,
    lora: LoraConfig | None = None,
) -> list[str]:
    """`python -m sglang.launch_server ...` for a server this replica starts itself (LoRA on
    when the job trains adapters; `launch_args` come last, so they override)."""
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(config.tp_size),
        "--mem-fraction-static",
        str(config.mem_fraction_static),
    ]
    if lora is not None:
        cmd += lora_launch_args(lora)
    return cmd + list(config.launch_args)


def parse_generate_response(
    item: dict[str, Any], fallback_version: int, *, adapter_version: int | None = None
) -> Completion:
    """One element of a /generate answer as a Completion; EngineError if it is malformed.

    `adapter_version`: the request ran under that version's LoRA adapter, which stamps it whole
    (an adapter never changes under a request); the server's own versions then describe the
    base model, which LoRA jobs never update."""
    try:
        meta = item["meta_info"]
        token_ids = [int(t) for t in item.get("output_ids") or []]
        entries = meta.get("output_token_logprobs") or []
        logprobs = [float(e[0]) if e[0] is not None else float("nan") for e in entries]
        finish = meta.get("finish_reason") or {}
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise EngineError(f"malformed /generate response: {type(exc).__name__}: {exc}") from None
    kind = finish.get("type") if isinstance(finish, dict) else None
    if len(logprobs) != len(token_ids):
        if kind != "abort":
            raise EngineError(
                f"/generate response {meta.get('id')!r}: {len(token_ids)} output_ids but "
                f"{len(logprobs)} output_token_logprobs (was return_logprob honoured?)"
            )
        # An aborted request may come back before its logprobs; it is discarded anyway.
        keep = min(len(token_ids), len(logprobs))
        token_ids, logprobs = token_ids[:keep], logprobs[:keep]
    reason: FinishReason = "abort" if kind == "abort" else "length" if kind == "length" else "stop"
    if kind not in ("stop", "length", "abort"):
        log.warning("sglang.unknown_finish_reason", finish=finish)
        reason = "abort"
    spans = meta.get("weight_versions") or []
    parsed = [_version(s.get("version")) for s in spans if isinstance(s, dict)]
    versions = [v for v in parsed if v is not None]
    current = _version(meta.get("weight_version"))
    if adapter_version is not None:
        versions = [adapter_version]
    elif not versions:
        versions = [current if current is not None else fallback_version]
    start, end = versions[0], versions[-1]
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=reason,
        version_start=start,
        version_end=end,
        matched_stop=finish.get("matched") if isinstance(finish, dict) else None,
        rid=str(meta.get("id", "")),
    )


def _aborted(answer: Any) -> bool:
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    return isinstance(finish, dict) and finish.get("type") == "abort"


class _Retryable(Exception):
    """One attempt of a call failed in a way the next may not (a connection error, 5xx, 429).
    `may_run`: the request may have reached the server and still run there."""

    def __init__(self, reason: str, *, may_run: bool) -> None:
        super().__init__(reason)
        self.may_run = may_run


def _version(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        if error is not None:
            return str(error)
        for key in ("message", "error_message", "detail"):
            if key in data:
                return str(data[key])
    return str(data)[:500]


class SGLangEngine(Engine):
    """Drives one SGLang server over HTTP. A bucketed update (broadcast, CUDA IPC) that fails
    after loading began leaves the server holding part of a version (`_torn`): it then stays
    paused and `generate` refuses until a whole version loads (weight-sync's catch-up).

    With `lora` (the job's `model.lora`) the server keeps its base weights and each version is
    a LoRA adapter (`load_adapter`): a request runs under the adapter current when it started,
    which stamps its version, and an adapter replaced by a newer one is unloaded once the last
    request under it has ended."""

    kind = "sglang"

    def __init__(
        self,
        config: SGLangEngineConfig,
        *,
        model_path: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        version: int = 0,
        lora: LoraConfig | None = None,
    ) -> None:
        self.config = config
        self.lora = lora
        self.url = config.url.rstrip("/")
        self.model_path = model_path
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._version = version
        self._paused = False
        self._pause_mode: PauseMode = "in_place"
        #: SGLang may hold part of a version (a bucketed update failed after loading began).
        self._torn = False
        # A prompt's rid -> the rids it may have running on the server, every attempt's (each
        # retry is sent under new ones), until answered or aborted.
        self._running: dict[str, set[str]] = {}
        self._ids = itertools.count()
        self._session = uuid.uuid4().hex[:8]
        #: LoRA: the adapter new requests run under (None: the base model, before version 1),
        #: how many requests run under each adapter, the replaced ones not unloaded yet, and
        #: the unloads under way.
        self._adapter: str | None = None
        self._adapter_users: dict[str, int] = {}
        self._retired: set[str] = set()
        self._unloads: set[asyncio.Task[None]] = set()

    @property
    def version(self) -> int:
        return self._version

    # -- HTTP ------------------------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            headers = {}
            if self.config.api_key_env and os.environ.get(self.config.api_key_env):
                headers["Authorization"] = f"Bearer {os.environ[self.config.api_key_env]}"
            self._client = httpx.AsyncClient(
                base_url=self.url,
                headers=headers,
                transport=self._transport,
                timeout=httpx.Timeout(
                    self.config.request_timeout_seconds,
                    connect=self.config.connect_timeout_seconds,
                ),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            )
        return self._client

    async def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        retry: bool = True,
    ) -> Any:
        """One API call; returns the decoded JSON (or text) of a 2xx answer. Connection errors,
        429 and 5xx are retried `max_retries` times with exponential backoff, then raise
        `EngineUnavailable`; a deadline raises `EngineTimeout`; another 4xx `EngineRejected`."""
        attempts = 1 + (self.config.max_retries if retry else 0)
        what = f"{method} {self.url}{path}"
        return await self._retrying(
            what, attempts, lambda _: self._send(method, path, body, timeout)
        )

    async def _retrying(
        self,
        what: str,
        attempts: int,
        attempt: Callable[[int], Awaitable[Any]],
        **context: Any,
    ) -> Any:
        """`attempt(k)` for k = 0, 1, ... with exponential backoff between them, until one
        returns or raises anything but `_Retryable`; `EngineUnavailable` after `attempts`."""
        last = ""
        for k in range(attempts):
            if k:
                delay = self.config.retry_backoff_seconds * 2 ** (k - 1)
                log.warning(
                    "sglang.retry", call=what, attempt=k, reason=last, delay=delay, **context
                )
                await asyncio.sleep(delay)
            try:
                return await attempt(k)
            except _Retryable as exc:
                last = str(exc)
        raise EngineUnavailable(f"{what} failed after {attempts} attempt(s): {last}")

    async def _send(
        self, method: str, path: str, body: dict[str, Any] | None, timeout: float | None
    ) -> Any:
        """One attempt of `call`: the decoded answer of a 2xx; `_Retryable`, `EngineTimeout` or
        `EngineRejected` otherwise."""
        what = f"{method} {self.url}{path}"
        try:
            response = await self._http().request(
                method,
                path,
                json=body,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except (httpx.ConnectTimeout, httpx.PoolTimeout, httpx.ConnectError) as exc:
            # Not connected yet: nothing reached the server; a timeout is retried like a refusal.
            raise _Retryable(f"{type(exc).__name__}: {exc}", may_run=False) from None
        except httpx.TimeoutException as exc:
            raise EngineTimeout(f"{what}: no answer in time ({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}", may_run=True) from None
        if response.status_code in _RETRY_STATUS:
            # SGLang may hold the rids past its answer (a failed handler aborts what it had
            # dispatched and keeps the rids until the scheduler confirms:
            # `TokenizerManager._release_req_states_on_failure`).
            message = f"HTTP {response.status_code}: {_message(response)}"
            raise _Retryable(message, may_run=True)
        if response.status_code >= 400:
            raise EngineRejected(
                f"{what} refused with HTTP {response.status_code}: {_message(response)}"
            )
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Launch the server when configured to (or recover one already running), then wait
        until it generates."""
        recovered = self.config.launch  # a server launched here starts unpaused, with no session
        if self.config.launch and self._process is None:
            if not self.model_path:
                raise EngineError("sglang.launch needs the model path")
            url = httpx.URL(self.url)
            cmd = launch_command(
                self.config, self.model_path, url.host, url.port or 30000, self.lora
            )
            log.info("sglang.launch", command=" ".join(cmd))
            self._process = subprocess.Popen(cmd)
        deadline = time.monotonic() + self.config.startup_timeout_seconds
        while True:
            if not recovered:
                recovered = await self._recover()
            if recovered and await self.health():
                break
            if self._process is not None and self._process.poll() is not None:
                raise EngineUnavailable(
                    f"sglang.launch_server exited with {self._process.returncode}"
                )
            if time.monotonic() > deadline:
                raise EngineUnavailable(
                    f"SGLang at {self.url} not healthy after "
                    f"{self.config.startup_timeout_seconds:.0f}s"
                )
            await asyncio.sleep(1.0)
        if self.lora is not None and not self.config.launch:
            await self._drop_stale_adapters()
        log.info("sglang.ready", url=self.url, version=self._version)

    async def _recover(self) -> bool:
        """Undo what a replica that died mid-update may have left on a server it did not launch
        (the SGLang container outlived the rollout container), so the server generates again;
        False while the server does not answer yet. In 0.5.23 a session left open refuses every
        later `begin` and `/end_weight_update` closes it (400 when none is open); a paused server
        holds every request, `/health_generate`'s included, and `/continue_generation` is harmless
        on one that is not. A session found open means SGLang may hold part of a version, so
        generation waits for a whole one. Details and sources: docs/rollout.md, "Attaching"."""
        try:
            await self.call("POST", "/end_weight_update", {}, timeout=30.0, retry=False)
        except EngineRejected as exc:
            log.debug("sglang.no_update_session", url=self.url, answer=str(exc))
        except (EngineUnavailable, EngineTimeout):
            return False
        else:
            self._torn = True
            log.warning(
                "sglang.update_session_ended",
                url=self.url,
                reason="left open by a replica that died mid-update; waiting for a whole version",
            )
        try:
            await self.call("POST", "/continue_generation", {}, timeout=30.0, retry=False)
        except (EngineUnavailable, EngineTimeout):
            return False
        self._paused = False
        return True

    async def close(self) -> None:
        if self._running:
            try:
                await self.abort_all()
            except EngineError as exc:
                log.warning("sglang.abort_on_close_failed", error=str(exc))
        if self._adapter is not None and self._process is None:
            # The server outlives this replica: it need not keep this session's adapter.
            self._retire(self._adapter)
            self._adapter = None
        if self._unloads:
            await asyncio.gather(*self._unloads, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._process is not None:
            self._process.terminate()
            try:
                await asyncio.to_thread(self._process.wait, 60)
            except subprocess.TimeoutExpired:
                self._process.kill()
            self._process = None

    async def health(self) -> bool:
        try:
            await self.call("GET", "/health_generate", timeout=30.0, retry=False)
        except EngineError:
            return False
        return True

    async def status(self) -> EngineStatus:
        return EngineStatus(
            self.kind,
            self._version,
            self._paused,
            running_requests=len(self._running),
            queued_requests=0,
            extra={"url": self.url, "lora_adapter": self._adapter or ""},
        )

    # -- generation ------------------------------------------------------------------------------

    async def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        return list(await asyncio.gather(*(self._generate_one(p, params) for p in prompts)))

    async def _generate_one(
        self, prompt: Sequence[int], params: SamplingParams
    ) -> list[Completion]:
        if not prompt:
            raise EngineRejected("prompt is empty")
        if self._torn:
            raise EngineUnavailable(
                f"SGLang at {self.url} may hold part of a version (a weight update failed "
                f"midway; version {self._version} is the last whole one): generation waits for "
                "the next whole version"
            )
        rid = self._new_rid()
        # Under LoRA the adapter and its version change together, between two requests: every
        # attempt of this one names the same adapter, which stays loaded until it ends.
        submitted_version, adapter = self._version, self._adapter
        self._running[rid] = set()
        self._hold(adapter)
        try:
            if params.n == 1:
                answer = await self._post_generate(
                    rid, lambda r: generate_body(prompt, params, r, adapter)
                )
            else:
                answer = await self._generate_group(prompt, params, rid, adapter)
        finally:
            self._running.pop(rid, None)
            self._release(adapter)
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != params.n or not all(isinstance(i, dict) for i in items):
            raise EngineError(
                f"/generate {rid}: expected {params.n} sample(s), got {len(items)} item(s)"
            )
        stamp = submitted_version if self.lora is not None else None
        return [
            parse_generate_response(item, submitted_version, adapter_version=stamp)
            for item in items
        ]

    async def _generate_group(
        self, prompt: Sequence[int], params: SamplingParams, rid: str, adapter: str | None
    ) -> Any:
        """n > 1 samples of one prompt as SGLang's parallel sampling runs them (prefill the prompt
        once, then the samples on its cached prefix), but under rids a timeout can abort: 0.5.23
        gives parallel samples fresh uuid rids (`regenerate_rid`) and drops the request's own
        from its table, so `/abort_request` with it reaches nothing."""
        answer = await self._post_generate(rid, lambda r: prefix_body(prompt, r, adapter))
        if _aborted(answer):
            # Aborted (a pause, a drain) before any sample started: so is the group.
            return [answer] * params.n
        return await self._post_generate(
            rid, lambda r: group_body(prompt, params, sample_rids(r, params.n), adapter)
        )

    async def _post_generate(self, rid: str, body_for: Callable[[str], dict[str, Any]]) -> Any:
        """One `/generate` of the prompt `rid`, retried as `call` retries, but every attempt under
        rids of its own (`body_for(attempt_rid(...))` is its body), and an attempt that failed
        after reaching the server aborted before the next: SGLang 0.5.23 holds a rid until it
        sees its request end (a dropped client's only once its poll for gone clients notices,
        `TokenizerManager._stream_one_response`) and refuses it meanwhile with 400 "Duplicate
        request ID" (`_init_req_state`). Past its deadline every request the prompt may still
        have on the server is aborted."""
        live = self._running[rid]
        attempts = 1 + self.config.max_retries

        async def attempt(k: int) -> Any:
            body = body_for(attempt_rid(rid, k, attempts))
            rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
            live.update(rids)
            try:
                answer = await self._send("POST", "/generate", body, None)
            except _Retryable as exc:
                if not exc.may_run:
                    live.difference_update(rids)
                await self._abort_live(live)
                raise
            except EngineTimeout:
                await self._abort_live(live)
                raise
            except EngineRejected:
                live.difference_update(rids)  # answered: SGLang has let them go
                raise
            live.difference_update(rids)
            return answer

        return await self._retrying(f"POST {self.url}/generate", attempts, attempt, rid=rid)

    def _new_rid(self) -> str:
        """A request id no other is a prefix of: SGLang aborts every request whose rid starts
        with the one given (`req.rid.startswith`), so aborting `...-1` would abort `...-10`."""
        return f"kuberl-{self._session}-{next(self._ids):012d}"

    async def _abort_live(self, rids: set[str]) -> None:
        """Abort each of `rids` on the server, best effort; those SGLang took leave the set (one
        it no longer holds is a no-op there). An abort that failed is logged, and the request
        ends when SGLang's poll finds its client gone."""

        async def abort(rid: str) -> str | None:
            try:
                await self.call("POST", "/abort_request", {"rid": rid}, timeout=10.0, retry=False)
            except EngineError as exc:
                log.warning("sglang.abort_failed", rid=rid, error=str(exc))
                return None
            return rid

        aborted = await asyncio.gather(*(abort(r) for r in sorted(rids)))
        rids.difference_update(aborted)

    # -- pause / abort ---------------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "in_place") -> int:
        if mode not in ("abort", "in_place"):
            raise ValueError(f"pause mode must be 'abort' or 'in_place', got {mode!r}")
        running = len(self._running)
        if mode == "abort" and self._paused and self._pause_mode == "in_place":
            # SGLang's abort-mode pause waits until no request runs, but a server paused in
            # place runs no batch, so its aborted requests never end: the pause (and with it
            # every later call) would hang for good. Abort them, let the scheduler finish them,
            # then pause.
            await self.call("POST", "/abort_request", {"abort_all": True})
            await self.call("POST", "/continue_generation", {})
            self._paused = False
        await self.call("POST", "/pause_generation", {"mode": mode})
        self._paused, self._pause_mode = True, mode
        return running if mode == "abort" else 0

    async def resume(self) -> None:
        if self._torn:
            # Continuing would serve a mix of two versions; the next whole update resumes.
            log.warning("sglang.stays_paused", url=self.url, reason="part of a version loaded")
            return
        await self.call("POST", "/continue_generation", {})
        self._paused = False

    async def abort_all(self) -> int:
        running = len(self._running)
        await self.call("POST", "/abort_request", {"abort_all": True})
        return running

    async def flush_cache(self) -> None:
        await self.call("POST", "/flush_cache")

    # -- weights ---------------------------------------------------------------------------------

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        await self.call(
            "POST",
            "/update_weights_from_disk",
            {"model_path": path, "weight_version": str(version), "flush_cache": True},
        )
        self._version = version
        self._torn = False  # a whole version from disk

    async def begin_weight_update(self) -> None:
        """Open an update session: 0.5.23 runs distributed and tensor updates only inside one,
        and an update's cache flush fails while requests run, so every update here is pause,
        begin, load, end, continue."""
        await self.call("POST", "/begin_weight_update", {})

    async def end_weight_update(self) -> None:
        await self.call("POST", "/end_weight_update", {})

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        await self.call(
            "POST",
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self.call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        version: int,
        group_name: str = "weight_update_group",
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """One bucket of a broadcast session, nothing more: a version arrives in several buckets,
        so the session (`begin_weight_update` ... `end_weight_update`) and the loaded version
        belong to the caller, which sets them once every bucket is in (`apply_broadcast` is that
        caller). Not retried: a bucket half-received cannot be asked for again."""
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "weight_version": str(version),
        }
        if load_format:
            body["load_format"] = load_format
        await self.call("POST", "/update_weights_from_distributed", body, retry=False)

    async def update_weights_from_tensor(
        self, serialized_named_tensors: Sequence[str], version: int, load_format: str | None = None
    ) -> None:
        body: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "flush_cache": True,
            "weight_version": str(version),
        }
        if load_format:
            body["load_format"] = load_format
        await self.begin_weight_update()
        try:
            await self.call("POST", "/update_weights_from_tensor", body, retry=False)
        finally:
            await self.end_weight_update()
        self._version = version
        self._torn = False  # the caller's payloads hold the whole version

    async def apply_broadcast(self, instruction: Any) -> None:
        """Receive one version broadcast by the trainer (a weight-sync UpdateInstruction with an
        NCCL group): begin, join the group, one update call per bucket while the trainer
        broadcasts it, leave the group, end. The caller pauses generation around it."""
        from kuberl.common.weights import sglang as bodies

        group = bodies.init_group_request(instruction)
        await self.begin_weight_update()
        try:
            await self.call("POST", "/init_weights_update_group", group, retry=False)
            try:
                for body in bodies.update_requests(instruction):
                    self._torn = True  # from the first bucket on, until the session ends well
                    await self.call("POST", "/update_weights_from_distributed", body, retry=False)
            finally:
                await self.call(
                    "POST",
                    "/destroy_weights_update_group",
                    bodies.destroy_group_request(instruction),
                )
        finally:
            await self.end_weight_update()
        self._version = int(instruction.version)
        self._torn = False

    async def apply_cuda_ipc(self, instruction: Any) -> None:
        """Load one version from the trainer's GPU buckets by CUDA IPC (a weight-sync
        UpdateInstruction with this engine's JSON handle set; the server shares the trainer's
        GPU): begin, one `/update_weights_from_tensor` per bucket in SGLang's flattened-bucket
        format (SGLang opens each bucket's handle, loads it and lets it go), end. The caller
        pauses generation around it. The bodies are built, and the handle set checked against
        the manifest, before anything is sent."""
        from kuberl.common.weights import sglang as bodies

        if self.config.tp_size != 1:
            raise EngineRejected(
                f"CUDA IPC updates go to an SGLang server with tp_size 1; this one has "
                f"{self.config.tp_size} (its versions come by NCCL or snapshot)"
            )
        try:
            requests = bodies.tensor_update_requests(instruction)
        except ValueError as exc:
            raise EngineRejected(
                f"CUDA IPC update to version {instruction.version}: {exc}"
            ) from None
        await self.begin_weight_update()
        try:
            for body in requests:
                self._torn = True  # from the first bucket on, until the session ends well
                await self.call("POST", "/update_weights_from_tensor", body, retry=False)
        finally:
            await self.end_weight_update()
        self._version = int(instruction.version)
        self._torn = False

    async def apply_snapshot(self, tensors_file: Path, version: int, snapshot_dir: Path) -> None:
        """Load a downloaded safetensors snapshot through a folder the server reads at the same
        path (`rollout.engine.snapshot_dir`; on Kubernetes a volume both containers of the pod
        mount); config files are copied from the model folder. The path goes to SGLang absolute:
        a relative one would be resolved against the SGLang server's working directory, not
        ours. Once SGLang has loaded a version, the folders of older ones are deleted (each is a
        whole model), so the folder holds at most the loaded version and the one arriving."""
        target = (snapshot_dir / f"v{version}").absolute()
        target.mkdir(parents=True, exist_ok=True)
        shutil.move(str(tensors_file), target / "model.safetensors")
        if self.model_path:
            for name in ("config.json", "generation_config.json"):
                src = Path(self.model_path) / name
                if src.exists():
                    shutil.copy(src, target / name)
        await self.update_weights_from_disk(str(target), version)
        for old in target.parent.glob("v*"):
            if old != target and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)

    # -- LoRA adapters ---------------------------------------------------------------------------

    async def load_adapter(self, tensors: Mapping[str, Any], version: int) -> None:
        """Serve `version`, the job's LoRA adapter as weight-sync delivers it (adapter tensors
        only, named as in the PEFT-injected model): write it in PEFT's saved format under
        `snapshot_dir` (a folder the server reads at the same path), load it under a name of its
        own with `/load_lora_adapter`, then send new requests to it. The adapter it replaces is
        unloaded, and its folder deleted, once no request runs under it."""
        from kuberl.common.lora import is_adapter_tensor, save_adapter

        if self.lora is None:
            raise EngineRejected(
                f"version {version} is a LoRA adapter but this engine serves full weights "
                "(model.lora is not set for the rollout service)"
            )
        foreign = sorted(n for n in tensors if not is_adapter_tensor(n))
        if foreign or not tensors:
            raise EngineRejected(
                f"version {version}: with model.lora set, a version carries LoRA adapter tensors "
                f"only, but this one has {len(foreign)} other tensor(s) of {len(tensors)} "
                f"({', '.join(foreign[:3])}): is the trainer running with the same model.lora?"
            )
        name = adapter_name(self._session, version)
        folder = Path(self.config.snapshot_dir) / name
        # Blocking file writes of a few MB, off the event loop that serves generation.
        await asyncio.to_thread(
            save_adapter, folder, list(tensors.items()), self.lora, self.model_path
        )
        try:
            # Not retried: a load whose answer was lost would be refused as "already loaded".
            await self.call(
                "POST", "/load_lora_adapter", load_adapter_body(name, folder), retry=False
            )
        except EngineError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        previous, self._adapter, self._version = self._adapter, name, version
        if previous is not None:
            self._retire(previous)
        log.info("sglang.adapter_loaded", adapter=name, version=version)

    async def _drop_stale_adapters(self) -> None:
        """Unload, with their folders, the adapters an earlier replica left on a server it did
        not launch (kuberl's names of another session): one that died never unloaded its last.
        SGLang lists loaded adapters in `/v1/models` as cards with a `parent` (the base)."""
        try:
            listing = await self.call("GET", "/v1/models", timeout=30.0)
        except EngineError as exc:
            log.warning("sglang.adapters_not_listed", url=self.url, error=str(exc))
            return
        cards = listing.get("data") if isinstance(listing, dict) else None
        ours = f"kuberl-{self._session}-"
        stale = [
            str(card["id"])
            for card in cards or []
            if isinstance(card, dict)
            and card.get("parent")
            and str(card.get("id", "")).startswith("kuberl-")
            and not str(card["id"]).startswith(ours)
        ]
        if stale:
            log.info("sglang.stale_adapters", url=self.url, adapters=stale)
        await asyncio.gather(*(self._unload(name) for name in stale))

    def _hold(self, adapter: str | None) -> None:
        if adapter is not None:
            self._adapter_users[adapter] = self._adapter_users.get(adapter, 0) + 1

    def _release(self, adapter: str | None) -> None:
        if adapter is None:
            return
        left = self._adapter_users[adapter] - 1
        if left:
            self._adapter_users[adapter] = left
            return
        del self._adapter_users[adapter]
        if adapter in self._retired:
            self._unload_soon(adapter)

    def _retire(self, adapter: str) -> None:
        """No new request goes to `adapter`; unload it once none runs under it. (SGLang's own
        unload would wait for them too, but a retried attempt naming it later would make
        SGLang load it again from its folder.)"""
        self._retired.add(adapter)
        if adapter not in self._adapter_users:
            self._unload_soon(adapter)

    def _unload_soon(self, adapter: str) -> None:
        task = asyncio.get_running_loop().create_task(self._unload(adapter))
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

    async def _unload(self, adapter: str) -> None:
        try:
            await self.call("POST", "/unload_lora_adapter", unload_adapter_body(adapter))
        except EngineError as exc:
            # Left loaded: SGLang evicts it from GPU memory when slots run short (LRU).
            log.warning("sglang.adapter_unload_failed", adapter=adapter, error=str(exc))
        finally:
            self._retired.discard(adapter)
            folder = Path(self.config.snapshot_dir) / adapter
            await asyncio.to_thread(shutil.rmtree, folder, True)
