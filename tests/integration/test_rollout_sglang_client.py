"""The `sglang` engine against a stand-in of SGLang's HTTP API (tests/integration/sglang_standin.py;
NOT SGLang, which cannot run here): parsing, retries, timeouts, error mapping, pause / abort and
the weight-update call sequences, including a replica's CUDA IPC update (pause, one tensor call
per bucket, continue) and an update that fails midway (SGLang stays paused)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kuberl.common.config import SGLangEngineConfig
from kuberl.common.redis_server import free_port
from kuberl.common.weights import Manifest
from kuberl.rollout.engine.base import (
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    SamplingParams,
)
from kuberl.rollout.engine.sglang import SGLangEngine
from tests.contract.test_sglang_contract import _instruction
from tests.integration.sglang_standin import SGLangStandIn


@pytest.fixture
def server() -> Iterator[SGLangStandIn]:
    with SGLangStandIn(vocab_size=100) as s:
        yield s


def _engine(url: str, **kw) -> SGLangEngine:
    config = SGLangEngineConfig(url=url, retry_backoff_seconds=0.01, **kw)
    return SGLangEngine(config)


def run(coro):
    return asyncio.run(coro)


async def _with(engine: SGLangEngine, coro):
    try:
        return await coro
    finally:
        await engine.close()


def _expected(prompt: list[int], sample: int, n_tokens: int) -> list[int]:
    return [(sum(prompt) * 31 + 13 * sample + 7 * i) % 100 for i in range(n_tokens)]


def test_generate_returns_n_samples_per_prompt_with_tokens_and_logprobs(server) -> None:
    engine = _engine(server.url)
    prompts = [[1, 2, 3], [4, 5]]
    params = SamplingParams(max_new_tokens=5, n=3, ignore_eos=True)
    out = run(_with(engine, engine.generate(prompts, params)))
    tokens = [[c.token_ids for c in samples] for samples in out]
    assert tokens == [[_expected(p, s, 5) for s in range(3)] for p in prompts]
    assert out[1][2].logprobs == pytest.approx([-0.01 * (i + 1) - 0.002 for i in range(5)])
    assert {c.finish_reason for s in out for c in s} == {"length"}


def test_a_stop_token_ends_the_sample_with_its_id_as_matched(server) -> None:
    # A prompt whose first samples avoid the stand-in's EOS (0): the stop id ends it.
    engine = _engine(server.url)
    stop = _expected([2, 3], 0, 5)[3]
    out = run(
        _with(
            engine,
            engine.generate(
                [[2, 3]],
                SamplingParams(max_new_tokens=5, stop_token_ids=(stop,)),
            ),
        )
    )[0][0]
    assert (out.token_ids, out.finish_reason, out.matched_stop) == (
        _expected([2, 3], 0, 4),
        "stop",
        stop,
    )


def test_stop_token_ids_with_ignore_eos_are_refused_as_sglang_would_ignore_them() -> None:
    # SGLang skips every token stop under ignore_eos; the torch engine stops at the ids. The
    # same job would silently run every sample to max_new_tokens on SGLang.
    from kuberl.common.config import ConfigError, parse_job_config

    engine = _engine("http://127.0.0.1:9")
    params = SamplingParams(max_new_tokens=5, stop_token_ids=(7,), ignore_eos=True)
    with pytest.raises(EngineRejected, match="ignores the stop token ids too"):
        run(_with(engine, engine.generate([[1, 2]], params)))
    sampling = {"ignore_eos": True, "stop_token_ids": [7]}
    with pytest.raises(ConfigError, match="ignores the stop token ids too"):
        parse_job_config({"rollout": {"engine": {"kind": "sglang"}, "sampling": sampling}}, env={})


def test_server_errors_are_retried_until_the_call_succeeds(server) -> None:
    server.inject("/generate", status=503, times=2)
    engine = _engine(server.url, max_retries=3)
    out = run(_with(engine, engine.generate([[1]], SamplingParams(max_new_tokens=2))))
    calls = [p for _, p, _ in server.requests if p == "/generate"]
    assert (len(out[0][0].token_ids), len(calls)) == (2, 3)


def test_a_dropped_connection_is_retried(server) -> None:
    server.inject("/generate", drop=True)
    engine = _engine(server.url, max_retries=2)
    out = run(_with(engine, engine.generate([[1]], SamplingParams(max_new_tokens=2))))
    assert len(out[0][0].token_ids) == 2


def test_a_generate_whose_connection_dropped_midway_is_retried_under_new_rids_and_aborted(
    server,
) -> None:
    # SGLang 0.5.23 holds a rid until its request ends (a dropped client's, until its 4 s poll
    # notices) and refuses it meanwhile: the retry, under the same rid, got 400 "Duplicate
    # request ID" (not retried) and the prompt failed, while the first attempt ran on.
    server.inject("/generate", hang_up=True)
    engine = _engine(server.url, max_retries=2)
    out = run(_with(engine, engine.generate([[1]], SamplingParams(max_new_tokens=2))))
    first = next(b["rid"] for _, p, b in server.requests if p == "/generate")
    assert (out[0][0].token_ids, server.state.aborted) == (_expected([1], 0, 2), [first])


def test_a_group_whose_samples_lost_their_connection_is_resampled_under_new_rids(server) -> None:
    server.inject("/generate")  # the prefill-only request goes through
    server.inject("/generate", hang_up=True)  # the batch of samples is cut off once running
    engine = _engine(server.url, max_retries=2)
    params = SamplingParams(max_new_tokens=2, n=3, ignore_eos=True)
    out = run(_with(engine, engine.generate([[1, 2]], params)))
    batches = [
        b["rid"] for _, p, b in server.requests if p == "/generate" and isinstance(b["rid"], list)
    ]
    tokens = [c.token_ids for c in out[0]]
    assert (tokens, sorted(server.state.aborted)) == (
        [_expected([1, 2], s, 2) for s in range(3)],
        sorted(batches[0]),
    )


def test_the_stand_in_refuses_a_rid_it_still_holds_as_sglang_0_5_23_does(server) -> None:
    # TokenizerManager._init_req_state: a rid in rid_to_state (or twice in one batch) is a
    # ValueError, which the /generate route answers with 400 and its message.
    import httpx

    server.inject("/generate", hang_up=True)
    body = {"rid": "a", "input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{server.url}/generate", json=body)
    again = httpx.post(f"{server.url}/generate", json=body)
    twice = httpx.post(
        f"{server.url}/generate", json=body | {"rid": ["b", "b"], "input_ids": [[1], [2]]}
    )
    assert [(r.status_code, r.json()) for r in (again, twice)] == [
        (400, {"error": {"message": f"Duplicate request ID detected: {rid}"}}) for rid in "ab"
    ]


def test_errors_beyond_the_retry_budget_raise_unavailable_with_the_last_status(server) -> None:
    server.inject("/generate", status=503, times=10)
    engine = _engine(server.url, max_retries=2)
    with pytest.raises(EngineUnavailable, match=r"/generate failed after 3 attempt\(s\): HTTP 503"):
        run(_with(engine, engine.generate([[1]], SamplingParams())))


def test_a_bad_request_is_rejected_with_the_servers_message_and_not_retried(server) -> None:
    engine = _engine(server.url, max_retries=3)
    with pytest.raises(EngineRejected, match="HTTP 400: input_ids must be a non-empty list"):
        run(_with(engine, engine.call("POST", "/generate", {"input_ids": "oops"})))
    assert sum(p == "/generate" for _, p, _ in server.requests) == 1


def test_a_generation_past_its_deadline_times_out_and_is_aborted_on_the_server(server) -> None:
    server.inject("/generate", delay=2.0)
    engine = _engine(server.url, request_timeout_seconds=0.3)
    with pytest.raises(EngineTimeout, match="no answer in time"):
        run(_with(engine, engine.generate([[1]], SamplingParams(max_new_tokens=2))))
    aborts = [b for _, p, b in server.requests if p == "/abort_request"]
    generated = next(b for _, p, b in server.requests if p == "/generate")
    assert aborts == [{"rid": generated["rid"]}]


def test_a_group_past_its_deadline_has_every_sample_aborted_on_the_server() -> None:
    # SGLang 0.5.23 runs n > 1 samples under fresh uuid rids (`regenerate_rid`): the abort that
    # named the request's own rid reached none of them, and they ran on to max_new_tokens.
    with SGLangStandIn(token_delay=0.01) as server:
        engine = _engine(server.url, request_timeout_seconds=0.3)
        params = SamplingParams(max_new_tokens=500, ignore_eos=True, n=3)
        with pytest.raises(EngineTimeout, match="no answer in time"):
            run(_with(engine, engine.generate([[1, 2]], params)))
        samples = [rid for rid, _, _ in server.state.prefills[1:]]  # after the prompt's prefill
        aborted = list(server.state.aborted)
    assert (len(samples), sorted(aborted)) == (3, sorted(samples))


def test_a_group_prefills_its_prompt_once_and_every_sample_finds_it_cached(server) -> None:
    # Parallel sampling's point: the prompt is computed once, the samples share its KV cache.
    engine = _engine(server.url)
    run(_with(engine, engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=2, n=4))))
    assert [cached for _, _, cached in server.state.prefills] == [0, 3, 3, 3, 3]


def test_a_group_whose_prefill_is_aborted_comes_back_aborted_without_sampling(server) -> None:
    # Aborted while the server is paused in place (a drain): sending the samples after it would
    # leave them held until the server continues.
    engine = _engine(server.url)

    async def go() -> list[str]:
        await engine.pause("in_place")
        task = asyncio.create_task(engine.generate([[1, 2]], SamplingParams(n=2)))
        while not server.state.running:
            await asyncio.sleep(0.01)
        await engine.abort_all()
        out = await asyncio.wait_for(task, 5)
        return [c.finish_reason for c in out[0]]

    reasons = run(_with(engine, go()))
    sent = [p for _, p, _ in server.requests if p == "/generate"]
    assert (reasons, sent) == (["abort", "abort"], ["/generate"])


def test_a_batch_of_copies_alone_would_prefill_the_prompt_once_per_copy(server) -> None:
    # Why the group's prefill-only request comes first: the copies of one batch arrive together
    # and (SGLang's default fcfs policy) are prefilled together, none finding another's cache.
    import httpx

    body = {"rid": ["a", "b"], "input_ids": [[1, 2, 3]] * 2, "sampling_params": {}}
    httpx.post(f"{server.url}/generate", json=body | {"sampling_params": {"max_new_tokens": 1}})
    assert [cached for _, _, cached in server.state.prefills] == [0, 0]


def test_an_unreachable_server_is_unavailable_and_unhealthy() -> None:
    with SGLangStandIn() as gone:
        url = gone.url
    engine = _engine(url, max_retries=1)
    assert run(engine.health()) is False
    with pytest.raises(EngineUnavailable, match="ConnectError"):
        run(_with(engine, engine.generate([[1]], SamplingParams())))


def test_pause_with_abort_ends_running_generations_as_aborted() -> None:
    with SGLangStandIn(token_delay=0.01) as server:
        engine = _engine(server.url)

        async def go():
            params = SamplingParams(max_new_tokens=500, ignore_eos=True, n=2)
            task = asyncio.create_task(engine.generate([[1, 2]], params))
            while not server.state.running:
                await asyncio.sleep(0.01)
            aborted = await engine.pause("abort")
            out = await task
            paused = (await engine.status()).paused
            await engine.resume()
            after = await engine.generate([[1, 2]], params.with_(max_new_tokens=2))
            return aborted, out, paused, after

        aborted, out, paused, after = run(_with(engine, go()))
    assert (aborted, paused) == (1, True)
    assert {c.finish_reason for c in out[0]} == {"abort"}
    assert all(len(c.token_ids) < 500 for c in out[0])
    assert [len(c.token_ids) for c in after[0]] == [2, 2]


def test_generation_waits_while_paused_in_place_and_continues_after_resume() -> None:
    with SGLangStandIn(token_delay=0.002) as server:
        engine = _engine(server.url)

        async def go():
            await engine.pause("in_place")
            task = asyncio.create_task(
                engine.generate([[3]], SamplingParams(max_new_tokens=5, ignore_eos=True))
            )
            await asyncio.sleep(0.3)
            waited = not task.done()
            await engine.resume()
            return waited, await task

        waited, out = run(_with(engine, go()))
    assert (waited, out[0][0].token_ids) == (True, _expected([3], 0, 5))


def test_a_distributed_update_outside_a_session_is_refused_as_sglang_0_5_23_does(server) -> None:
    engine = _engine(server.url)
    with pytest.raises(EngineRejected, match="must run between begin_weight_update"):
        run(_with(engine, engine.update_weights_from_distributed(["w"], ["float32"], [[1]], 1)))


def test_a_broadcast_update_runs_the_whole_session_and_stamps_the_new_version(server) -> None:
    engine = _engine(server.url)
    instruction = _instruction()

    async def go():
        await engine.apply_broadcast(instruction)
        return await engine.generate([[1]], SamplingParams(max_new_tokens=2))

    out = run(_with(engine, go()))
    calls = [p for _, p, _ in server.requests if p != "/generate"]
    buckets = Manifest.from_proto(instruction.manifest).num_buckets
    assert calls == [
        "/begin_weight_update",
        "/init_weights_update_group",
        *["/update_weights_from_distributed"] * buckets,
        "/destroy_weights_update_group",
        "/end_weight_update",
    ]
    assert (engine.version, out[0][0].version_start, out[0][0].version_end) == (3, 3, 3)


def test_an_update_from_a_missing_folder_is_rejected_and_keeps_the_version(
    server, tmp_path: Path
) -> None:
    engine = _engine(server.url)

    async def go():
        with pytest.raises(EngineRejected, match="not found"):
            await engine.update_weights_from_disk(str(tmp_path / "nope"), 2)
        kept = engine.version
        await engine.update_weights_from_disk(str(tmp_path), 2)
        return kept

    kept = run(_with(engine, go()))
    assert (kept, engine.version, server.state.weight_version) == (0, 2, "2")


def test_a_snapshot_goes_to_sglang_as_an_absolute_path_and_older_ones_are_deleted(
    server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The SGLang server has its own working directory: a relative path would name another folder.
    monkeypatch.chdir(tmp_path)
    engine = _engine(server.url)

    async def go() -> None:
        for version in (2, 3):
            download = tmp_path / f"download-{version}.safetensors"
            download.write_bytes(b"weights")
            await engine.apply_snapshot(download, version, Path("sglang-weights"))

    run(_with(engine, go()))
    sent = [body["model_path"] for _, path, body in server.state.requests if "disk" in path]
    left = sorted(p.name for p in (tmp_path / "sglang-weights").iterdir())
    assert (sent, left) == (
        [str(tmp_path / "sglang-weights" / "v2"), str(tmp_path / "sglang-weights" / "v3")],
        ["v3"],
    )


def test_flushing_the_cache_while_requests_run_is_refused() -> None:
    with SGLangStandIn(token_delay=0.01) as server:
        engine = _engine(server.url)

        async def go():
            task = asyncio.create_task(
                engine.generate([[1]], SamplingParams(max_new_tokens=300, ignore_eos=True))
            )
            deadline = time.monotonic() + 10
            while not server.state.running and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            try:
                await engine.flush_cache()
            finally:
                await engine.abort_all()
                await task

        with pytest.raises(EngineRejected, match="requests are running"):
            run(_with(engine, go()))


# -- CUDA IPC (an SGLang server on the trainer's GPU) -------------------------------------------


def _cuda_ipc() -> tuple[Any, int]:
    """A CUDA IPC instruction for version 5 (handles point at nothing: the stand-in does not
    open them) and its number of buckets."""
    from tests.contract.test_sglang_tensor_update import cuda_ipc_instruction, tensors, version

    manifest, _ = version(tensors())
    return cuda_ipc_instruction(manifest, 5), manifest.num_buckets


def test_a_cuda_ipc_update_posts_one_tensor_call_per_bucket_in_one_session(server) -> None:
    engine = _engine(server.url)
    instruction, buckets = _cuda_ipc()
    run(_with(engine, engine.apply_cuda_ipc(instruction)))
    calls = [(p, b.get("flush_cache"), b.get("weight_version")) for _, p, b in server.requests]
    assert calls == [
        ("/begin_weight_update", None, None),
        *[("/update_weights_from_tensor", False, None)] * (buckets - 1),
        ("/update_weights_from_tensor", True, "5"),  # SGLang reports v5 once it holds all of it
        ("/end_weight_update", None, None),
    ]


class _Replica:
    """A rollout replica (RolloutService) on an SGLang engine, with its worker but no loop
    running: enough for the path a weight-sync instruction takes (`_apply_instruction`, called
    from the weight-sync client's thread)."""

    def __init__(self, url: str) -> None:
        from kuberl.common.config import parse_job_config
        from kuberl.rollout.server import RolloutService

        config = parse_job_config(
            {"rollout": {"engine": {"kind": "sglang", "url": url, "retry_backoff_seconds": 0.01}}},
            env={},
        )
        self.service = RolloutService(config)
        self.engine = SGLangEngine(config.rollout.engine)  # type: ignore[arg-type]
        self.service.engine = self.engine
        self.service.weights = SimpleNamespace(engine_id="replica-0")

    async def __aenter__(self) -> _Replica:
        from kuberl.rollout.worker import RolloutWorker

        self.service._loop = asyncio.get_running_loop()
        self.service.worker = RolloutWorker(
            self.service.config, self.engine, None, buffer=None, reward=None, replica_id="r0"
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.engine.close()

    async def apply(self, instruction: Any) -> None:
        await asyncio.to_thread(self.service._apply_instruction, instruction)


def test_a_replica_pauses_sglang_loads_a_version_by_cuda_ipc_then_continues(server) -> None:
    instruction, buckets = _cuda_ipc()

    async def go() -> tuple[int, int]:
        async with _Replica(server.url) as replica:
            await replica.apply(instruction)
            out = await replica.engine.generate([[1]], SamplingParams(max_new_tokens=2))
            return replica.engine.version, out[0][0].version_start

    versions = run(go())
    calls = [p for _, p, _ in server.requests if p != "/generate"]
    assert calls == [
        "/pause_generation",
        "/begin_weight_update",
        *["/update_weights_from_tensor"] * buckets,
        "/end_weight_update",
        "/continue_generation",
    ]
    assert (versions, server.state.weight_version) == ((5, 5), "5")


def test_an_update_failing_midway_keeps_sglang_paused_until_a_whole_version_is_loaded(
    server, tmp_path: Path
) -> None:
    instruction, _ = _cuda_ipc()
    server.inject("/update_weights_from_tensor")  # the first bucket loads
    server.inject("/update_weights_from_tensor", status=400)  # the second is refused
    generate = SamplingParams(max_new_tokens=2)

    async def go() -> tuple[str, int]:
        async with _Replica(server.url) as replica:
            worker = replica.service.worker
            assert worker is not None
            with pytest.raises(EngineRejected, match="injected 400"):
                await replica.apply(instruction)
            with pytest.raises(EngineUnavailable) as refused:  # never reaches the server
                await replica.engine.generate([[1]], generate)
            # The weight-sync service catches a failed engine up by snapshot: a whole version.
            await worker.apply_weight_update(
                5, lambda: replica.engine.update_weights_from_disk(str(tmp_path), 5)
            )
            out = await replica.engine.generate([[1]], generate)
            return str(refused.value), out[0][0].version_start

    refused, version = run(go())
    calls = [p for _, p, _ in server.requests]
    assert calls == [
        "/pause_generation",
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/update_weights_from_tensor",  # refused: SGLang may hold part of version 5
        "/end_weight_update",
        # no /continue_generation, no /generate while torn
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
        "/generate",
    ]
    assert ("may hold part of a version" in refused, version) == (True, 5)


@pytest.mark.parametrize(
    ("tp_size", "offered"), [(1, ("cuda_ipc", "nccl", "snapshot")), (2, ("nccl", "snapshot"))]
)
def test_an_sglang_replica_offers_cuda_ipc_only_with_one_tensor_parallel_rank(
    monkeypatch: pytest.MonkeyPatch, tp_size: int, offered: tuple[str, ...]
) -> None:
    import kuberl.common.weights
    import kuberl.rollout.server

    registered: dict[str, Any] = {}

    class Client:  # records how the replica joins weight-sync
        last_error = ""

        def __init__(self, address: str, **kw: Any) -> None:
            registered.update(kw)

        def start(self) -> int:
            return 0

        def wait_for_version(self, version: int, timeout: float) -> bool:
            return True

    async def serving(name: str, address: str, timeout: float) -> None:
        return None

    monkeypatch.setattr(kuberl.common.weights, "EngineClient", Client)
    monkeypatch.setattr(kuberl.rollout.server, "wait_for_dependency", serving)
    replica = _Replica("http://127.0.0.1:9")
    replica.service.config.rollout.engine.tp_size = tp_size  # type: ignore[union-attr]
    run(replica.service._join_weight_sync())
    assert (registered["transports"], registered["ranks"]) == (offered, tp_size)


# -- launch: true --------------------------------------------------------------------------------
# SGLang cannot run here, so `python -m sglang.launch_server` resolves to a STAND-IN package put
# first on PYTHONPATH: its launch_server records its argv, then serves the SGLang API stand-in on
# --host/--port (or exits with the code in KUBERL_FAKE_LAUNCH_EXIT). The engine's own Popen,
# health wait, exit detection and shutdown run for real.
FAKE_LAUNCH_SERVER = """\
import argparse, json, os, sys
sys.path.insert(0, {repo!r})
code = int(os.environ.get("KUBERL_FAKE_LAUNCH_EXIT", "-1"))
with open(os.environ["KUBERL_FAKE_LAUNCH_ARGV"], "w") as f:
    json.dump({{"argv": sys.argv[1:], "pid": os.getpid()}}, f)
if code >= 0:
    sys.exit(code)
parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
args, _ = parser.parse_known_args()
from tests.integration.sglang_standin import SGLangStandIn
SGLangStandIn(port=args.port, vocab_size=100)._server.serve_forever()
"""


@pytest.fixture
def fake_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from tests.support import REPO

    package = tmp_path / "standin" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""STAND-IN sglang package (tests only)."""\n')
    (package / "launch_server.py").write_text(FAKE_LAUNCH_SERVER.format(repo=str(REPO)))
    monkeypatch.setenv("PYTHONPATH", str(package.parent))
    argv = tmp_path / "argv.json"
    monkeypatch.setenv("KUBERL_FAKE_LAUNCH_ARGV", str(argv))
    return argv


def test_launch_starts_the_server_waits_until_it_generates_and_stops_it_on_close(
    fake_launch: Path,
) -> None:
    import json
    import os

    port = free_port()
    config = SGLangEngineConfig(
        url=f"http://127.0.0.1:{port}",
        launch=True,
        launch_args=["--context-length", "4096"],
        startup_timeout_seconds=60,
    )
    engine = SGLangEngine(config, model_path="/models/tiny")

    async def go() -> tuple[list[int], Any]:
        await engine.start()
        process = engine._process
        out = await engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))
        await engine.close()
        return out[0][0].token_ids, process

    tokens, process = run(go())
    launched = json.loads(fake_launch.read_text())
    assert tokens == _expected([1, 2, 3], 0, 4)  # served by the launched process
    argv = launched["argv"]
    flags = dict(zip(argv[::2], argv[1::2], strict=False))
    assert (flags["--model-path"], flags["--host"], flags["--port"]) == (
        "/models/tiny",
        "127.0.0.1",
        str(port),
    )
    assert argv[-2:] == ["--context-length", "4096"] and launched["pid"] == process.pid
    assert process.poll() is not None and engine._process is None  # stopped and reaped
    with pytest.raises(ProcessLookupError):
        os.kill(launched["pid"], 0)


def test_a_launched_server_that_exits_fails_the_start_with_its_exit_code(
    fake_launch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERL_FAKE_LAUNCH_EXIT", "3")
    config = SGLangEngineConfig(
        url=f"http://127.0.0.1:{free_port()}", launch=True, startup_timeout_seconds=60
    )
    engine = SGLangEngine(config, model_path="/models/tiny")
    started = time.monotonic()
    with pytest.raises(EngineUnavailable, match="sglang.launch_server exited with 3"):
        run(_with(engine, engine.start()))
    assert time.monotonic() - started < 30  # noticed at once, not at startup_timeout_seconds


def test_launch_without_a_model_path_is_refused_before_anything_starts(fake_launch: Path) -> None:
    from kuberl.rollout.engine.base import EngineError

    engine = SGLangEngine(SGLangEngineConfig(url="http://127.0.0.1:9", launch=True))
    with pytest.raises(EngineError, match="needs the model path"):
        run(_with(engine, engine.start()))
    assert engine._process is None and not fake_launch.exists()


def test_no_request_id_is_a_prefix_of_another() -> None:
    # SGLang aborts every request whose rid starts with the rid it is given: aborting
    # "kuberl-<session>-1" (a timed-out generate) also aborted "...-10" to "...-19".
    engine = _engine("http://127.0.0.1:9")
    rids = sorted(engine._new_rid() for _ in range(1200))
    assert not any(b.startswith(a) for a, b in itertools.pairwise(rids))


def test_no_rid_of_any_attempt_of_a_prompt_is_a_prefix_of_another() -> None:
    # A retry's rids are new (SGLang refuses one it still holds) and, as aborts match by prefix,
    # none may prefix another attempt's: "-a1" would prefix "-a10".
    from kuberl.rollout.engine.sglang import attempt_rid, prefix_body, sample_rids

    attempts = [attempt_rid("kuberl-x-000000000001", a, 11) for a in range(11)]
    group = [r for a in attempts for r in [prefix_body([1], a)["rid"], *sample_rids(a, 12)]]
    clash = [
        (a, b)
        for rids in (sorted(attempts), sorted(group))
        for a, b in itertools.pairwise(rids)
        if b.startswith(a)
    ]
    assert clash == []


def test_a_connect_timeout_is_retried_like_a_refused_connection() -> None:
    # httpx.ConnectTimeout is a TimeoutException: it once raised EngineTimeout at once, where the
    # docs promise connection errors are retried. A stand-in transport (no network here drops
    # SYNs reliably): the first two connects time out, the third is answered.
    import httpx

    tries: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        tries.append(request.url.path)
        if len(tries) < 3:
            raise httpx.ConnectTimeout("timed out", request=request)
        return httpx.Response(200, json={"ok": True})

    config = SGLangEngineConfig(url="http://sglang:30000", retry_backoff_seconds=0.01)
    engine = SGLangEngine(config, transport=httpx.MockTransport(handler))
    assert run(_with(engine, engine.call("GET", "/health"))) == {"ok": True}
    assert tries == ["/health"] * 3


def test_an_abort_pause_of_a_server_paused_in_place_aborts_and_continues_first(server) -> None:
    # SGLang's abort-mode pause waits until no request runs; paused in place, the server runs no
    # batch, so the aborted requests never end and the pause (and every later call) hung for
    # good (read in SGLang 0.5.23: tokenizer_manager.pause_generation, scheduler). The client now
    # aborts, lets the scheduler run, then pauses.
    engine = _engine(server.url)

    async def go() -> None:
        await engine.pause("in_place")
        await engine.pause("abort")
        await engine.resume()

    run(_with(engine, go()))
    control = [
        (path, body)
        for _, path, body in server.requests
        if path in ("/pause_generation", "/abort_request", "/continue_generation")
    ]
    assert control == [
        ("/pause_generation", {"mode": "in_place"}),
        ("/abort_request", {"abort_all": True}),
        ("/continue_generation", {}),
        ("/pause_generation", {"mode": "abort"}),
        ("/continue_generation", {}),
    ]


# -- attaching to a server a dead replica left behind ---------------------------------------------


def test_a_replica_attaching_to_a_server_left_paused_continues_it_and_is_ready_at_once() -> None:
    # A rollout container that died mid-update leaves its SGLang container's server paused, and
    # a paused server holds /health_generate (0.5.23 answers 503 after 20 s): the restarted
    # replica waited until startup_timeout_seconds and failed.
    with SGLangStandIn(health_check_timeout=0.2) as server:
        server.state.paused = True
        engine = _engine(server.url, startup_timeout_seconds=3)

        async def go() -> list[int]:
            await engine.start()
            out = await engine.generate([[3]], SamplingParams(max_new_tokens=2, ignore_eos=True))
            return out[0][0].token_ids

        started = time.monotonic()
        tokens = run(_with(engine, go()))
        took = time.monotonic() - started
    assert (tokens, took < 2) == (_expected([3], 0, 2), True)


def test_a_replica_attaching_ends_an_update_session_left_open_and_waits_for_a_whole_version(
    server,
) -> None:
    # A replica that died between begin_weight_update and end_weight_update left the session
    # open: 0.5.23 refused every later begin ("already open"), and SGLang may hold part of a
    # version, which the new replica served.
    server.state.session = True
    engine = _engine(server.url, startup_timeout_seconds=3)
    generate = SamplingParams(max_new_tokens=2)

    async def go() -> int:
        await engine.start()
        with pytest.raises(EngineUnavailable, match="may hold part of a version"):
            await engine.generate([[1]], generate)
        await engine.apply_broadcast(_instruction())  # begins a session: the old one is gone
        out = await engine.generate([[1]], generate)
        return out[0][0].version_start

    assert run(_with(engine, go())) == 3
