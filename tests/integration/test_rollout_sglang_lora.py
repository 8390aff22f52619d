"""The `sglang` engine with `model.lora`, against the SGLang API stand-in
(tests/integration/sglang_standin.py; NOT SGLang, which cannot run here) launched "with LoRA":
each version is an adapter written as a PEFT folder and loaded under a name of its own, requests
run under the adapter current when they started and are stamped with its version, a replaced
adapter is unloaded once its last request ended, and a replica receives the adapters through
the real weight-sync service (a `kuberl serve weight_sync` subprocess)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kuberl.common.config import LoraConfig, SGLangEngineConfig
from kuberl.common.lora import save_adapter
from kuberl.rollout.engine.base import EngineRejected, SamplingParams
from kuberl.rollout.engine.sglang import SGLangEngine
from tests.integration.sglang_standin import SGLangStandIn

TARGETS = ("q_proj", "v_proj")
LORA = LoraConfig(rank=4, alpha=8, target_modules=list(TARGETS))
VOCAB = 100


def adapter(shift: int, rank: int = 4, layers: int = 2, hidden: int = 8) -> dict[str, Any]:
    """Adapter tensors as weight-sync delivers them (the PEFT-injected model's names), whose
    values add up to `shift`: the stand-in shifts every token it generates under them by that."""
    out: dict[str, Any] = {}
    for i in range(layers):
        for module in TARGETS:
            stem = f"model.layers.{i}.self_attn.{module}"
            out[f"{stem}.lora_A.default.weight"] = torch.zeros(rank, hidden)
            out[f"{stem}.lora_B.default.weight"] = torch.zeros(hidden, rank)
    out["model.layers.0.self_attn.q_proj.lora_B.default.weight"][0, 0] = float(shift)
    return out


def expected(prompt: list[int], n_tokens: int, shift: int = 0, sample: int = 0) -> list[int]:
    return [(sum(prompt) * 31 + 13 * sample + shift + 7 * i) % VOCAB for i in range(n_tokens)]


@pytest.fixture
def server() -> Iterator[SGLangStandIn]:
    with SGLangStandIn(vocab_size=VOCAB, lora_max_rank=8, lora_target_modules=TARGETS) as s:
        yield s


def _engine(url: str, folder: Path, lora: LoraConfig | None = LORA) -> SGLangEngine:
    config = SGLangEngineConfig(url=url, retry_backoff_seconds=0.01, snapshot_dir=str(folder))
    return SGLangEngine(config, lora=lora)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _closing(engine: SGLangEngine, coro: Any) -> Any:
    try:
        return await coro
    finally:
        await engine.close()


PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


def test_a_version_is_loaded_as_a_peft_folder_and_new_requests_run_under_it(
    server, tmp_path: Path
) -> None:
    engine = _engine(server.url, tmp_path / "weights")

    async def go() -> list[int]:
        await engine.load_adapter(adapter(shift=5), 1)
        return (await engine.generate([[1, 2]], PARAMS))[0][0].token_ids

    tokens = run(go())  # engine left open: the adapter's folder is still there
    (body,) = [b for _, p, b in server.requests if p == "/load_lora_adapter"]
    folder = Path(body["lora_path"])
    config = json.loads((folder / "adapter_config.json").read_text())
    generated = [b for _, p, b in server.requests if p == "/generate"]
    assert (folder.is_absolute(), config["r"], sorted(config["target_modules"])) == (
        True,
        4,
        sorted(TARGETS),
    )
    assert [b.get("lora_path") for b in generated] == [body["lora_name"]]
    assert tokens == expected([1, 2], 4, shift=5)
    run(engine.close())


def test_completions_carry_the_adapters_version_while_the_servers_stays_put(
    server, tmp_path: Path
) -> None:
    engine = _engine(server.url, tmp_path)

    async def go() -> list[tuple[int, int]]:
        stamps = [(await engine.generate([[3]], PARAMS))[0][0]]  # the base model: version 0
        for version in (1, 2):
            await engine.load_adapter(adapter(shift=version), version)
            stamps += (await engine.generate([[3]], PARAMS.with_(n=2)))[0]
        return [(c.version_start, c.version_end) for c in stamps]

    stamps = run(_closing(engine, go()))
    assert (stamps, server.state.weight_version) == (
        [(0, 0), (1, 1), (1, 1), (2, 2), (2, 2)],
        "0",
    )


def test_a_group_prefills_and_samples_under_the_same_adapter(server, tmp_path: Path) -> None:
    engine = _engine(server.url, tmp_path)

    async def go() -> list[list[int]]:
        await engine.load_adapter(adapter(shift=9), 1)
        return [c.token_ids for c in (await engine.generate([[4]], PARAMS.with_(n=3)))[0]]

    tokens = run(_closing(engine, go()))
    names = {b.get("lora_path") for _, p, b in server.requests if p == "/generate"}
    assert (len(names), None in names) == (1, False)
    assert tokens == [expected([4], 4, shift=9, sample=s) for s in range(3)]


def test_the_replaced_adapter_is_unloaded_only_once_its_last_request_has_ended(
    tmp_path: Path,
) -> None:
    with SGLangStandIn(
        vocab_size=VOCAB, token_delay=0.01, lora_max_rank=8, lora_target_modules=TARGETS
    ) as server:
        engine = _engine(server.url, tmp_path)

        async def go() -> tuple[list[str], list[str], Any]:
            await engine.load_adapter(adapter(shift=1), 1)
            first = engine._adapter
            slow = asyncio.create_task(
                engine.generate([[1]], SamplingParams(max_new_tokens=60, ignore_eos=True))
            )
            while not server.state.running:
                await asyncio.sleep(0.01)
            await engine.load_adapter(adapter(shift=2), 2)
            await engine.generate([[1]], PARAMS)  # under version 2, while 1's request runs
            during = list(server.state.unloaded)
            old = (await slow)[0][0]
            deadline = time.monotonic() + 10
            while not server.state.unloaded and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return during, [first, *server.state.unloaded], old

        during, (first, *unloaded), old = run(_closing(engine, go()))
    assert (during, unloaded, server.state.reloaded) == ([], [first], [])
    assert (old.version_start, old.version_end) == (1, 1)
    assert not (tmp_path / first).exists()


def test_a_request_retried_after_its_adapter_was_replaced_still_finds_it_loaded(
    server, tmp_path: Path
) -> None:
    # Its first attempt fails with 503 while version 2 arrives; the retry names version 1's
    # adapter again, which SGLang would otherwise have to load anew from its folder.
    engine = _engine(server.url, tmp_path)

    async def go() -> Any:
        await engine.load_adapter(adapter(shift=1), 1)
        first = engine._adapter
        server.inject("/generate", status=503, delay=0.5)
        task = asyncio.create_task(engine.generate([[1]], PARAMS))
        await asyncio.sleep(0.1)
        await engine.load_adapter(adapter(shift=2), 2)
        return first, (await task)[0][0]

    first, out = run(_closing(engine, go()))
    retried = [b["lora_path"] for _, p, b in server.requests if p == "/generate"]
    assert (retried, server.state.reloaded) == ([first, first], [])
    assert (out.token_ids, out.version_start) == (expected([1], 4, shift=1), 1)


def test_full_weights_where_an_adapter_was_expected_are_refused_naming_model_lora(
    server, tmp_path: Path
) -> None:
    engine = _engine(server.url, tmp_path)
    full = {**adapter(shift=1), "model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8)}
    with pytest.raises(EngineRejected, match="same model.lora"):
        run(_closing(engine, engine.load_adapter(full, 1)))
    assert [p for _, p, _ in server.requests] == []


def test_an_adapter_sglang_refuses_leaves_the_previous_version_serving(
    server, tmp_path: Path
) -> None:
    big = LoraConfig(rank=16, target_modules=list(TARGETS))  # the server allows rank 8
    engine = _engine(server.url, tmp_path, lora=big)

    async def go() -> tuple[int, list[str]]:
        with pytest.raises(EngineRejected, match="max-lora-rank"):
            await engine.load_adapter(adapter(shift=1, rank=16), 1)
        out = await engine.generate([[2]], PARAMS)
        return out[0][0].version_start, out[0][0].token_ids

    version, tokens = run(_closing(engine, go()))
    assert (version, tokens, list(tmp_path.iterdir())) == (0, expected([2], 4), [])


def test_an_engine_without_model_lora_refuses_an_adapter(server, tmp_path: Path) -> None:
    engine = _engine(server.url, tmp_path, lora=None)
    with pytest.raises(EngineRejected, match="model.lora is not set"):
        run(_closing(engine, engine.load_adapter(adapter(shift=1), 1)))


def test_closing_unloads_the_adapter_from_a_server_that_outlives_the_replica(
    server, tmp_path: Path
) -> None:
    engine = _engine(server.url, tmp_path)

    async def go() -> str:
        await engine.load_adapter(adapter(shift=1), 1)
        return str(engine._adapter)

    name = run(_closing(engine, go()))
    assert (server.state.unloaded, server.state.adapters, list(tmp_path.iterdir())) == (
        [name],
        {},
        [],
    )


# -- a replica on the real weight-sync service ------------------------------------------------


class _LoraReplica:
    """A rollout replica (RolloutService) of a LoRA job on an SGLang engine, with its worker but
    no rollout loop: it joins a real weight-sync service and loads what is published."""

    def __init__(self, url: str, weight_sync: str, folder: Path) -> None:
        from kuberl.common.config import parse_job_config
        from kuberl.rollout.server import RolloutService
        from kuberl.rollout.worker import RolloutWorker

        config = parse_job_config(
            {
                "model": {"lora": LORA.model_dump()},
                "rollout": {
                    "engine": {"kind": "sglang", "url": url, "snapshot_dir": str(folder)},
                    "catch_up_seconds": 30,
                },
                "endpoints": {"weight_sync": weight_sync},
                "weight_sync": {"transports": ["shm", "snapshot"]},
            },
            env={},
        )
        self.service = RolloutService(config)
        self.engine = SGLangEngine(config.rollout.engine, lora=config.model.lora)  # type: ignore[arg-type]
        self.service.engine = self.engine
        self.service.worker = RolloutWorker(
            config, self.engine, None, buffer=None, reward=None, replica_id="r0"
        )

    async def __aenter__(self) -> _LoraReplica:
        self.service._loop = asyncio.get_running_loop()
        await self.service._join_weight_sync()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.service.weights.stop)
        await self.engine.close()


def _reported(address: str, version: int, timeout: float = 60.0) -> None:
    """Wait until the weight-sync service has every engine's report of `version` loaded."""
    from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
    from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
    from kuberl.common.channels import sync_channel

    deadline = time.monotonic() + timeout
    with sync_channel(address) as channel:
        stub = pb_grpc.WeightSyncServiceStub(channel)
        while time.monotonic() < deadline:
            engines = stub.GetStatus(pb.GetStatusRequest(), timeout=10).engines
            if engines and min(e.loaded_version for e in engines) >= version:
                return
            time.sleep(0.05)
    raise AssertionError(f"version {version} not reported loaded within {timeout:.0f}s")


@pytest.mark.parametrize("transport", ["shm", "snapshot"])
def test_a_replica_loads_each_published_adapter_through_weight_sync(
    server, tmp_path: Path, transport: str
) -> None:
    from kuberl.common.weights import WeightPublisher
    from tests.integration.test_weight_sync import _service

    (tmp_path / "ws").mkdir()
    with contextmanager(_service)(tmp_path / "ws", [transport, "snapshot"]) as svc:

        async def go() -> tuple[list[int], tuple[int, int], list[tuple[int, str]]]:
            async with _LoraReplica(server.url, svc.address, tmp_path / "weights") as replica:
                client = replica.service.weights
                with WeightPublisher(svc.address) as publisher:
                    for version in (1, 2):
                        publisher.publish(version, iter(adapter(shift=10 * version).items()))
                        # Loaded as the service sees it: one still busy with version 1 when 2
                        # is committed would catch up by snapshot.
                        await asyncio.to_thread(_reported, svc.address, version)
                out = (await replica.engine.generate([[1, 2]], PARAMS))[0][0]
                return out.token_ids, (out.version_start, replica.engine.version), [*client.history]

        tokens, versions, history = run(go())
    loads = [b["lora_name"] for _, p, b in server.requests if p == "/load_lora_adapter"]
    assert (tokens, versions) == (expected([1, 2], 4, shift=20), (2, 2))
    assert (history, server.state.reloaded) == ([(1, transport), (2, transport)], [])
    # version 1's adapter when 2 replaced it, version 2's when the replica closed
    assert (len(loads), server.state.unloaded) == (2, loads)


def test_a_replica_attaching_unloads_what_an_earlier_replica_left_and_nothing_else(
    server, tmp_path: Path
) -> None:
    engine = _engine(server.url, tmp_path)
    (tmp_path / "kuberl-0dead0-v7").mkdir()
    save_dir = tmp_path / "peft"
    save_adapter(save_dir, adapter(shift=1).items(), LORA)
    for name in ("kuberl-0dead0-v7", "someone-elses"):
        answer = httpx.post(
            f"{server.url}/load_lora_adapter", json={"lora_name": name, "lora_path": str(save_dir)}
        )
        assert answer.status_code == 200
    run(_closing(engine, engine.start()))
    assert (server.state.unloaded, sorted(server.state.adapters)) == (
        ["kuberl-0dead0-v7"],
        ["someone-elses"],
    )
    assert not (tmp_path / "kuberl-0dead0-v7").exists()
