"""A STAND-IN for an SGLang server, for tests only: it is NOT SGLang and generates no real text.

SGLang cannot run where kuberl is developed (no GPU), so the `sglang` engine's HTTP behaviour —
retries, timeouts, error mapping, pause / abort, the weight-update call sequence — is tested
against this small stdlib HTTP server that answers the routes of SGLang 0.5.23's native API
(`sglang/srt/entrypoints/http_server.py`) with the same status codes and JSON shapes:

- `/generate` answers `output_ids`, `meta_info.output_token_logprobs` ([logprob, id, null]),
  `finish_reason` ({"type": "stop", "matched": id} / {"type": "length", "length": n} /
  {"type": "abort", "message": ...}), `weight_version`, `weight_versions` and `cached_tokens`;
  a list for n > 1 or a batch (`input_ids` a list of prompts, `rid` a list). Tokens are a
  deterministic function of the prompt and the sample's index (its place in the batch, or among
  the n samples), not a model; unknown sampling parameters are refused with 400 like SGLang's
  contract gate; requests wait while paused, like SGLang's.
- as in 0.5.23's `TokenizerManager._handle_batch_request`, n > 1 (parallel sampling) first runs
  a prefill-only copy of the prompt, then the samples under fresh uuid rids
  (`regenerate_rid`), which `meta_info.id` reports; the request's own rid is forgotten, so an
  abort naming it reaches nothing. A batch keeps the rids it was given.
- a prefix cache: a finished request's tokens are kept; a request's `cached_tokens` is the
  longest kept prefix of its prompt, at most all but its last token
  (`Req._compute_max_prefix_len`), looked up when it arrives, so the copies of one batch do not
  find each other (0.5.23's default `fcfs` policy prefills them together; its in-batch prefix
  check runs only under cache-aware policies such as `lpm`). `prefills` records
  `(rid, prompt length, cached tokens)` per request.
- a rid is held from a request's arrival until it ends, and a request naming a rid still held
  (or one rid twice in a batch) is refused whole with 400 "Duplicate request ID detected: <rid>"
  (0.5.23 `TokenizerManager._init_req_state`, answered by `_create_error_response`).
- `/abort_request {rid}` reaches a request only when one has exactly that rid (the tokenizer
  manager's `rid_to_state` lookup), and then every running request whose rid starts with it (the
  scheduler's `startswith`); `aborted` records the rid of every request aborted.
- `/pause_generation` (abort / in_place), `/continue_generation`, `/flush_cache` (400 while
  requests run), `/health_generate` (held while paused, 503 after `health_check_timeout`).
- weight updates: `/update_weights_from_disk`, `/init_weights_update_group`,
  `/destroy_weights_update_group`, `/begin_weight_update` / `/end_weight_update` (the 0.5.23
  session that `/update_weights_from_distributed` and `/update_weights_from_tensor` require).
- LoRA (a server launched with `--enable-lora`: `lora_max_rank` and `lora_target_modules` set):
  `/load_lora_adapter {lora_name, lora_path}` reads the PEFT folder at `lora_path`
  (`adapter_config.json`, `adapter_model.safetensors` with PEFT's `base_model.model.` names) and
  refuses, with 0.5.23's 400 `{success: false, error_message}`, a name already loaded or an
  adapter whose rank or target modules the launch did not provide for; `/unload_lora_adapter
  {lora_name}` waits until no request runs under it (`wait_for_unload`). A `/generate` naming an
  adapter (`lora_path`) runs under it, and an adapter once loaded but since unloaded is loaded
  again from its path first (`_resolve_lora_path`; recorded in `reloaded`). An adapter shifts
  every generated token by the rounded sum of its tensors' values, so a test can tell which
  adapter made a sample. `weight_version` stays the base model's. Without LoRA enabled both
  routes and a `/generate` naming an adapter are refused with 400. `/v1/models` lists the base
  model's card and one per loaded adapter (`parent`: the base).
- missing required fields get FastAPI's 422, unknown routes 404.

Faults are injected per route (`inject`): an HTTP status for the next k calls, a delay, a
connection dropped before the request starts (`drop`), or one dropped once it runs
(`hang_up`, /generate only). As in 0.5.23, a request whose client hung up runs on, holding its
rids, until it is aborted or SGLang's poll for gone clients notices (`disconnect_poll`:
`SGLANG_REQUEST_STATE_WAIT_TIMEOUT`, 4 s, in `TokenizerManager._stream_one_response`, then
`abort_request`); its tokens are read by nobody, so the stand-in makes none. A request that
keeps its client is not polled: it runs to its end. Every request is recorded in `requests` for
assertions. Run it in a thread (`with SGLangStandIn() as s: s.url`) or as a process
(`python sglang_standin.py --port-file f`).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
}  # fmt: skip
REQUIRED = {
    "/update_weights_from_disk": ["model_path"],
    "/init_weights_update_group": ["master_address", "master_port", "rank_offset", "world_size"],
    "/update_weights_from_distributed": ["names", "dtypes", "shapes"],
    "/update_weights_from_tensor": ["serialized_named_tensors"],
    "/load_lora_adapter": ["lora_name", "lora_path"],
    "/unload_lora_adapter": ["lora_name"],
}
LORA_OFF = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


@dataclass
class Adapter:
    path: str
    rank: int
    shift: int
    users: int = 0


@dataclass
class Fault:
    status: int | None = None
    delay: float = 0.0
    drop: bool = False
    hang_up: bool = False
    times: int = 1


@dataclass
class _Running:
    rid: str
    abort: threading.Event = field(default_factory=threading.Event)


class StandInState:
    def __init__(
        self,
        vocab_size: int,
        token_delay: float,
        eos_token_id: int,
        health_check_timeout: float,
        disconnect_poll: float,
        lora_max_rank: int | None = None,
        lora_target_modules: tuple[str, ...] = (),
    ) -> None:
        self.lora_max_rank = lora_max_rank
        self.lora_target_modules = set(lora_target_modules)
        self.adapters: dict[str, Adapter] = {}  # loaded, by name
        self.known_adapters: dict[str, str] = {}  # every name ever loaded -> its path
        self.reloaded: list[str] = []
        self.unloaded: list[str] = []
        self.vocab_size = vocab_size
        self.token_delay = token_delay
        self.eos_token_id = eos_token_id
        self.health_check_timeout = health_check_timeout
        self.disconnect_poll = disconnect_poll
        self.weight_version = "0"
        self.paused = False
        self.session = False
        self.groups: set[str] = set()
        self.running: dict[str, _Running] = {}
        self.cache: list[tuple[int, ...]] = []  # token sequences of finished requests
        self.prefills: list[tuple[str, int, int]] = []  # (rid, prompt length, cached tokens)
        self.aborted: list[str] = []
        self.faults: dict[str, list[Fault]] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self.cond = threading.Condition()

    def cached_tokens(self, prompt: list[int]) -> int:
        """The prompt's longest prefix among the kept sequences, at most all but its last token
        (SGLang recomputes the last one for its logits)."""
        best = 0
        for seq in self.cache:
            n = 0
            for a, b in zip(prompt, seq, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(prompt) - 1)

    def abort(self, running: _Running) -> None:
        if not running.abort.is_set():
            running.abort.set()
            self.aborted.append(running.rid)

    def take_fault(self, path: str) -> Fault | None:
        with self.cond:
            queue = self.faults.get(path) or []
            if not queue:
                return None
            fault = queue[0]
            fault.times -= 1
            if fault.times <= 0:
                queue.pop(0)
            return fault


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    hang_up = False  # this request's connection drops once it runs (an injected fault)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    # -- plumbing --------------------------------------------------------------------------------

    def _send(self, status: int, payload: Any = None, text: str | None = None) -> None:
        data = (text if text is not None else json.dumps(payload)).encode()
        self.send_response(status)
        kind = "text/plain" if text is not None else "application/json"
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _dispatch(self, method: str) -> None:
        state = self.server.state
        path = self.path.split("?", 1)[0]
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            self._send(400, {"error": {"message": "body is not JSON"}})
            return
        with state.cond:
            state.requests.append((method, path, body))
        fault = state.take_fault(path)
        self.hang_up = fault is not None and fault.hang_up
        if fault is not None:
            time.sleep(fault.delay)
            if fault.drop:
                self.close_connection = True
                self.connection.shutdown(2)
                return
            if fault.status is not None:
                self._send(fault.status, {"error": {"message": f"injected {fault.status}"}})
                return
        routes = {
            ("GET", "/health_generate"): self._health,
            ("GET", "/health"): self._health,
            ("GET", "/v1/models"): self._models,
            ("POST", "/generate"): self._generate,
            ("PUT", "/generate"): self._generate,
            ("POST", "/pause_generation"): self._pause,
            ("POST", "/continue_generation"): self._continue,
            ("POST", "/abort_request"): self._abort,
            ("POST", "/flush_cache"): self._flush,
            ("GET", "/flush_cache"): self._flush,
            ("POST", "/update_weights_from_disk"): self._from_disk,
            ("POST", "/begin_weight_update"): self._begin,
            ("POST", "/end_weight_update"): self._end,
            ("POST", "/init_weights_update_group"): self._init_group,
            ("POST", "/destroy_weights_update_group"): self._destroy_group,
            ("POST", "/update_weights_from_distributed"): self._from_distributed,
            ("POST", "/update_weights_from_tensor"): self._from_tensor,
            ("POST", "/load_lora_adapter"): self._load_lora,
            ("POST", "/unload_lora_adapter"): self._unload_lora,
        }
        handler = routes.get((method, path))
        if handler is None:
            self._send(404, {"detail": "Not Found"})
            return
        missing = [k for k in REQUIRED.get(path, []) if not isinstance(body, dict) or k not in body]
        if missing:
            detail = [
                {"type": "missing", "loc": ["body", k], "msg": "Field required"} for k in missing
            ]
            self._send(422, {"detail": detail})
            return
        handler(body if isinstance(body, dict) else {})

    # -- routes ----------------------------------------------------------------------------------

    def _health(self, body: dict[str, Any]) -> None:
        # SGLang 0.5.23's `health_generate` (http_server.py) sends a one-token request and
        # answers 200 once anything comes back within HEALTH_CHECK_TIMEOUT (20 s), else 503; a
        # paused server holds that request (`TokenizerManager.generate_request` waits on
        # `is_pause_cond` until `continue_generation`), so while paused it is never healthy.
        state = self.server.state
        deadline = time.monotonic() + state.health_check_timeout
        with state.cond:
            while state.paused and time.monotonic() < deadline:
                state.cond.wait(min(0.05, max(deadline - time.monotonic(), 0.0)))
            healthy = not state.paused
        self._send(200 if healthy else 503, text="")

    def _generate(self, body: dict[str, Any]) -> None:
        state = self.server.state
        ids = body.get("input_ids")
        params = body.get("sampling_params") or {}
        unknown = sorted(set(params) - SAMPLING_KEYS)
        if unknown:
            self._send(400, {"error": f"unknown field `{unknown[0]}` in sampling_params"})
            return
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        if not all(
            isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts
        ):
            self._send(400, {"error": {"message": "input_ids must be a non-empty list of ints"}})
            return
        given = body.get("rid")
        if batch:
            rids = given if isinstance(given, list) else [None] * len(prompts)
            if len(rids) != len(prompts):  # GenerateReqInput._normalize_rid
                msg = "The specified rids length mismatch with the batch_size for batch processing."
                self._send(400, {"error": {"message": msg}})
                return
        else:
            rids = [given]
        adapter, refusal = self._adapter_for(body.get("lora_path"))
        if refusal:
            self._send(400, {"error": {"message": refusal}})
            return
        n = int(params.get("n", 1))
        # (rid, prompt, sample index) of every request the scheduler gets. Parallel sampling
        # (0.5.23 `_handle_batch_request`) sends each sample under a fresh `regenerate_rid()`
        # uuid; the rid it was given is dropped.
        jobs: list[tuple[str, list[int], int]] = []
        for i, (prompt, rid) in enumerate(zip(prompts, rids, strict=True)):
            if n > 1:
                jobs += [(uuid.uuid4().hex, prompt, s) for s in range(n)]
            else:
                jobs.append((str(rid or uuid.uuid4().hex), prompt, i))
        running = [_Running(rid) for rid, _, _ in jobs]
        with state.cond:
            # 0.5.23 `_init_req_state`: every rid given, before anything runs, against the rids
            # held and the batch's own; one clash refuses the whole request.
            held = set(state.running)
            duplicate = next(
                (r for i, r in enumerate(rids) if r and (r in held or r in rids[:i])), None
            )
            if duplicate is None:
                for r in running:
                    state.running[r.rid] = r
            if duplicate is None and adapter is not None:
                adapter.users += 1
        if duplicate is not None:
            msg = f"Duplicate request ID detected: {duplicate}"
            self._send(400, {"error": {"message": msg}})
            return
        try:
            self._run(body, prompts, jobs, running, params, batch, n, adapter)
        finally:
            if adapter is not None:
                with state.cond:
                    adapter.users -= 1
                    state.cond.notify_all()

    def _run(
        self,
        body: dict[str, Any],
        prompts: list[list[int]],
        jobs: list[tuple[str, list[int], int]],
        running: list[_Running],
        params: dict[str, Any],
        batch: bool,
        n: int,
        adapter: Adapter | None,
    ) -> None:
        state = self.server.state
        if self.hang_up:
            self._run_without_client(running)
            return
        with state.cond:
            while state.paused and not all(r.abort.is_set() for r in running):  # SGLang holds
                state.cond.wait(0.05)
            if n > 1:  # parallel sampling's prefill-only copy of each prompt, awaited first
                for prompt in prompts:
                    state.prefills.append(
                        (uuid.uuid4().hex, len(prompt), state.cached_tokens(prompt))
                    )
                    state.cache.append(tuple(prompt))
            cached = [state.cached_tokens(prompt) for _, prompt, _ in jobs]  # prefilled together
            for (rid, prompt, _), c in zip(jobs, cached, strict=True):
                state.prefills.append((rid, len(prompt), c))
        try:
            shift = adapter.shift if adapter is not None else 0
            items = [
                self._sample(prompt, params, s, r, c, shift)
                for (_, prompt, s), r, c in zip(jobs, running, cached, strict=True)
            ]
        finally:
            with state.cond:
                for r in running:
                    state.running.pop(r.rid, None)
                state.cond.notify_all()
        self._send(200, items if batch or n > 1 else items[0])

    def _run_without_client(self, running: list[_Running]) -> None:
        """The client's connection drops with the request running: it holds its rids until it
        is aborted or `disconnect_poll` passes (SGLang's poll for gone clients, which aborts)."""
        state = self.server.state
        self.close_connection = True
        self.connection.shutdown(2)
        deadline = time.monotonic() + state.disconnect_poll
        with state.cond:
            while not all(r.abort.is_set() for r in running) and time.monotonic() < deadline:
                state.cond.wait(0.05)
            for r in running:
                state.abort(r)  # by the poll, if the client did not
                state.running.pop(r.rid, None)
            state.cond.notify_all()

    def _sample(
        self,
        ids: list[int],
        params: dict[str, Any],
        s: int,
        running: _Running,
        cached: int,
        shift: int = 0,
    ) -> dict[str, Any]:
        state = self.server.state
        rid = running.rid
        # As SGLang 0.5.23: ignore_eos skips every token stop, the stop ids included.
        stop_ids = set(params.get("stop_token_ids") or [])
        stop_ids.add(state.eos_token_id)
        if params.get("ignore_eos"):
            stop_ids = set()
        limit = int(params.get("max_new_tokens", 128))
        out: list[int] = []
        versions: list[str] = []
        finish: dict[str, Any] = {"type": "length", "length": limit}
        if running.abort.is_set():  # aborted while held, a prefill-only request included
            finish, limit = {"type": "abort", "message": "Abort in waiting queue"}, 0
        base = sum(ids) * 31 + 13 * s + shift
        for i in range(limit):
            if state.token_delay:
                time.sleep(state.token_delay)
            with state.cond:
                while state.paused and not running.abort.is_set():
                    state.cond.wait(0.05)
                version = state.weight_version
            if running.abort.is_set():
                finish = {"type": "abort", "message": "Abort in waiting queue"}
                break
            token = (base + 7 * i) % state.vocab_size
            out.append(token)
            versions.append(version)
            if token in stop_ids:
                finish = {"type": "stop", "matched": token}
                break
        with state.cond:
            state.cache.append(tuple(ids + out))
        spans: list[dict[str, Any]] = []
        for i, v in enumerate(versions):
            if spans and spans[-1]["version"] == v:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": v, "start": i, "end": i + 1})
        return {
            "text": " ".join(map(str, out)),
            "output_ids": out,
            "meta_info": {
                "id": rid,
                "prompt_tokens": len(ids),
                "completion_tokens": len(out),
                "finish_reason": finish,
                "output_token_logprobs": [
                    [-0.01 * (i + 1) - 0.001 * s, t, None] for i, t in enumerate(out)
                ],
                "weight_version": state.weight_version,
                "weight_versions": spans,
                "e2e_latency": 0.0,
                "cached_tokens": cached,
            },
        }

    def _pause(self, body: dict[str, Any]) -> None:
        state = self.server.state
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            self._send(422, {"detail": [{"loc": ["body", "mode"], "msg": "bad mode"}]})
            return
        with state.cond:
            state.paused = True
            if mode == "abort":
                for r in state.running.values():
                    state.abort(r)
            state.cond.notify_all()
        if mode == "abort":  # SGLang returns once nothing is running
            with state.cond:
                while state.running:
                    state.cond.wait(0.05)
        self._send(200, {"message": "Generation paused successfully.", "status": "ok"})

    def _continue(self, body: dict[str, Any]) -> None:
        state = self.server.state
        with state.cond:
            state.paused = False
            state.cond.notify_all()
        self._send(200, {"message": "Generation continued successfully.", "status": "ok"})

    def _abort(self, body: dict[str, Any]) -> None:
        # 0.5.23: `TokenizerManager.abort_request` forwards an abort only for a rid it holds a
        # request state for (one tokenizer worker), and `Scheduler.abort_request` then aborts
        # every request whose rid starts with it.
        state = self.server.state
        rid = str(body.get("rid") or "")
        with state.cond:
            for r in list(state.running.values()):
                if body.get("abort_all") or (rid in state.running and r.rid.startswith(rid)):
                    state.abort(r)
            state.cond.notify_all()
        self._send(200, text="")

    def _flush(self, body: dict[str, Any]) -> None:
        if self.server.state.running:
            self._send(400, text="Flush cache failed: requests are running.\n")
        else:
            self._send(200, text="Cache flushed.\n")

    def _weights_done(self, body: dict[str, Any], message: str) -> None:
        state = self.server.state
        if body.get("flush_cache", True) and state.running:
            self._send(
                400,
                {
                    "success": False,
                    "message": "Weights were updated, but the cache was not flushed because "
                    "requests are still running or queued.",
                },
            )
            return
        if body.get("weight_version") is not None:
            state.weight_version = str(body["weight_version"])
        self._send(200, {"success": True, "message": message})

    def _from_disk(self, body: dict[str, Any]) -> None:
        if not Path(body["model_path"]).exists():
            self._send(400, {"success": False, "message": f"{body['model_path']} not found"})
            return
        self._weights_done(body, "Succeeded to update model weights.")

    def _begin(self, body: dict[str, Any]) -> None:
        state = self.server.state
        if state.session:
            msg = "a weight-update session is already open; call end_weight_update() first"
            self._send(400, {"success": False, "message": msg})
            return
        state.session = True
        self._send(200, {"success": True, "message": "Success"})

    def _end(self, body: dict[str, Any]) -> None:
        state = self.server.state
        if not state.session:
            msg = "no weight-update session is open; call begin_weight_update() first"
            self._send(400, {"success": False, "message": msg})
            return
        state.session = False
        self._send(200, {"success": True, "message": "Success"})

    def _init_group(self, body: dict[str, Any]) -> None:
        self.server.state.groups.add(body.get("group_name", "weight_update_group"))
        self._send(200, {"success": True, "message": "Succeeded to initialize group."})

    def _destroy_group(self, body: dict[str, Any]) -> None:
        self.server.state.groups.discard(body.get("group_name", "weight_update_group"))
        self._send(200, {"success": True, "message": "Succeeded to destroy group."})

    def _needs_session(self, what: str) -> bool:
        if not self.server.state.session:
            msg = f"{what} must run between begin_weight_update() and end_weight_update()"
            self._send(400, {"success": False, "message": msg})
            return False
        return True

    def _from_distributed(self, body: dict[str, Any]) -> None:
        if not self._needs_session("update_weights_from_distributed"):
            return
        group = body.get("group_name", "weight_update_group")
        if group not in self.server.state.groups:
            self._send(400, {"success": False, "message": f"Group {group} not initialized"})
            return
        if not len(body["names"]) == len(body["dtypes"]) == len(body["shapes"]):
            self._send(400, {"success": False, "message": "names/dtypes/shapes differ in length"})
            return
        self._weights_done(body, "Succeeded to update parameter online.")

    def _from_tensor(self, body: dict[str, Any]) -> None:
        if self._needs_session("update_weights_from_tensor"):
            self._weights_done(body, "Success")

    # -- LoRA ------------------------------------------------------------------------------------

    def _adapter_for(self, name: Any) -> tuple[Adapter | None, str]:
        """The adapter a /generate names (None: the base model), or why it is refused."""
        state = self.server.state
        if not name:
            return None, ""
        if state.lora_max_rank is None:
            return None, f"LoRA adapter '{name}' was requested, but LoRA is not enabled."
        with state.cond:
            adapter = state.adapters.get(name)
            path = state.known_adapters.get(name)
        if adapter is not None:
            return adapter, ""
        if path is None:
            return None, f"Got LoRA adapter that has never been loaded: {name}"
        loaded, error = self._read_adapter(str(name), path)
        if loaded is None:
            return None, f"Failed to implicitly load LoRA adapter {name}: {error}"
        with state.cond:
            state.reloaded.append(str(name))
            state.adapters[str(name)] = loaded
        return loaded, ""

    def _read_adapter(self, name: str, path: str) -> tuple[Adapter | None, str]:
        """The PEFT folder at `path` as the server would hold it, or why it cannot be loaded."""
        from safetensors.torch import load_file

        state = self.server.state
        folder = Path(path)
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
            tensors = load_file(str(folder / "adapter_model.safetensors"))
        except (OSError, ValueError) as exc:
            return None, f"{type(exc).__name__}: {exc}"
        targets = set(config["target_modules"])
        allowed = state.lora_target_modules
        assert state.lora_max_rank is not None
        if config["r"] > state.lora_max_rank or not ("all" in allowed or targets <= allowed):
            return None, (
                f"LoRA adapter {name} with rank {config['r']} is incompatible with the current "
                "LoRA memory pool configuration. Please ensure that the LoRA adapter's rank is "
                "within the configured `--max-lora-rank` and that the target modules are "
                "included in `--lora-target-modules`."
            )
        strays = [k for k in tensors if not k.startswith("base_model.model.") or "lora_" not in k]
        if strays:
            return None, f"not PEFT LoRA weights: {strays[:3]}"
        total = sum(float(t.double().sum()) for t in tensors.values())
        return Adapter(path, int(config["r"]), round(total) % state.vocab_size), ""

    def _models(self, body: dict[str, Any]) -> None:
        # 0.5.23 `available_models`: the base model's card, then one per loaded adapter.
        state = self.server.state
        cards: list[dict[str, Any]] = [{"id": "base", "object": "model", "root": "base"}]
        with state.cond:
            cards += [
                {"id": name, "object": "model", "root": a.path, "parent": "base"}
                for name, a in state.adapters.items()
            ]
        self._send(200, {"object": "list", "data": cards})

    def _load_lora(self, body: dict[str, Any]) -> None:
        state = self.server.state
        name, path = str(body["lora_name"]), str(body["lora_path"])
        if state.lora_max_rank is None:
            self._send(400, {"success": False, "error_message": LORA_OFF})
            return
        with state.cond:
            taken = name in state.adapters
        if taken:
            msg = f"Failed to load LoRA adapter {name} because it is already loaded"
            self._send(400, {"success": False, "error_message": msg})
            return
        adapter, error = self._read_adapter(name, path)
        if adapter is None:
            self._send(400, {"success": False, "error_message": error})
            return
        with state.cond:
            state.adapters[name] = adapter
            state.known_adapters[name] = path
            loaded = {n: a.path for n, a in state.adapters.items()}
        self._send(200, {"success": True, "error_message": None, "loaded_adapters": loaded})

    def _unload_lora(self, body: dict[str, Any]) -> None:
        state = self.server.state
        name = str(body["lora_name"])
        if state.lora_max_rank is None:
            self._send(400, {"success": False, "error_message": LORA_OFF})
            return
        with state.cond:
            adapter = state.adapters.pop(name, None)
            if adapter is not None:  # no new request gets it; those under it finish first
                while adapter.users:
                    state.cond.wait(0.05)
                state.unloaded.append(name)
            loaded = {n: a.path for n, a in state.adapters.items()}
        if adapter is None:
            msg = f"LoRA with name {name} does not exist. Loaded LoRAs: {list(loaded)}"
            self._send(400, {"success": False, "error_message": msg})
            return
        self._send(200, {"success": True, "error_message": None, "loaded_adapters": loaded})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: StandInState

    def handle_error(self, request: Any, client_address: Any) -> None:
        return  # injected dropped connections end in resets; nothing to report


class SGLangStandIn:
    """The stand-in server on 127.0.0.1 in a background thread."""

    def __init__(
        self,
        *,
        port: int = 0,
        vocab_size: int = 100,
        token_delay: float = 0.0,
        eos_token_id: int = 0,
        health_check_timeout: float = 20.0,
        disconnect_poll: float = 4.0,
        lora_max_rank: int | None = None,
        lora_target_modules: tuple[str, ...] = (),
    ) -> None:
        """`lora_max_rank`: launched with `--enable-lora --max-lora-rank` this and
        `--lora-target-modules` these (None: without LoRA)."""
        self.state = StandInState(
            vocab_size,
            token_delay,
            eos_token_id,
            health_check_timeout,
            disconnect_poll,
            lora_max_rank,
            tuple(lora_target_modules),
        )
        self._server = _Server(("127.0.0.1", port), _Handler)
        self._server.state = self.state
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def requests(self) -> list[tuple[str, str, Any]]:
        return self.state.requests

    def inject(
        self,
        path: str,
        *,
        status: int | None = None,
        delay: float = 0.0,
        drop: bool = False,
        hang_up: bool = False,
        times: int = 1,
    ) -> None:
        """Make the next `times` calls to `path` fail with `status`, wait `delay`, drop before
        they start (`drop`) or once they run (`hang_up`); a fault with none of these lets its
        calls through."""
        fault = Fault(status, delay, drop, hang_up, times)
        with self.state.cond:
            self.state.faults.setdefault(path, []).append(fault)

    def start(self) -> SGLangStandIn:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.state.cond:
            for r in self.state.running.values():
                r.abort.set()
            self.state.paused = False
            self.state.cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> SGLangStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="SGLang API stand-in (tests only; not SGLang)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file")
    parser.add_argument("--vocab-size", type=int, default=100)
    parser.add_argument("--token-delay", type=float, default=0.0)
    args = parser.parse_args()
    server = SGLangStandIn(port=args.port, vocab_size=args.vocab_size, token_delay=args.token_delay)
    if args.port_file:
        port = server._server.server_address[1]
        Path(args.port_file).write_text(json.dumps({"port": port, "metrics_port": 0}))
    server._server.serve_forever()


if __name__ == "__main__":
    main()
