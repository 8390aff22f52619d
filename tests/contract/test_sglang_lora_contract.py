"""The `sglang` engine's LoRA requests and launch flags, checked against SGLang 0.5.23's source.

As `test_sglang_contract.py` does for the rest of the client (and with its readers of the
pinned package's source): the client of a `model.lora` job is driven through loading,
generating under, replacing and unloading adapters with an in-memory transport; each request's
route, method and body are checked against `http_server.py` and `io_struct.py`, the launch flags
against `arg_groups/fields/lora.py`, and the adapter folder it writes is read by SGLang's own
`LoRAConfig` (`srt/lora/lora_config.py`, which needs only `huggingface_hub`). The facts of SGLang's
LoRA handling the engine rests on are pinned from the source too. None of this ran against a
live SGLang server.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kuberl.common.config import LoraConfig, SGLangEngineConfig
from kuberl.common.config.model import DECODER_LINEAR_LAYERS
from kuberl.common.config.rollout import SGLANG_LORA_TARGET_MODULES
from kuberl.rollout.engine.base import SamplingParams
from kuberl.rollout.engine.sglang import LORA_ADAPTERS_PER_BATCH, SGLangEngine, launch_command
from tests.contract.test_sglang_contract import (
    SGLANG,
    _against_sglang,
    _api_types,
    _function,
    _launch_flags,
    _routes,
    pytestmark,  # noqa: F401  (skips the module without the sglang package)
)

LORA = LoraConfig(rank=8, alpha=16)


def adapter_tensors(layers: int = 2, hidden: int = 8) -> dict[str, torch.Tensor]:
    """What weight-sync delivers for a LoRA version: the PEFT-injected model's adapter tensors."""
    out = {}
    for i in range(layers):
        for module in ("self_attn.q_proj", "mlp.down_proj"):
            stem = f"model.layers.{i}.{module}"
            out[f"{stem}.lora_A.default.weight"] = torch.randn(LORA.rank, hidden)
            out[f"{stem}.lora_B.default.weight"] = torch.zeros(hidden, LORA.rank)
    return out


def _answer(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/generate":
        body = json.loads(request.content)
        rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
        items = [
            {
                "output_ids": [5],
                "meta_info": {
                    "id": rid,
                    "finish_reason": {"type": "length", "length": 1},
                    "output_token_logprobs": [[-0.5, 5, None]],
                    "weight_version": "default",
                },
            }
            for rid in rids
        ]
        return httpx.Response(200, json=items if isinstance(body["rid"], list) else items[0])
    if request.url.path in ("/load_lora_adapter", "/unload_lora_adapter"):
        return httpx.Response(200, json={"success": True, "loaded_adapters": {}})
    return httpx.Response(200, json={"success": True, "message": "ok"})


@pytest.fixture(scope="module")
def sent(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str, Any]]:
    """Every (method, path, body) of a LoRA job's engine over two versions, then its close."""
    captured: list[tuple[str, str, Any]] = []
    folder = tmp_path_factory.mktemp("sglang-weights")

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        captured.append((request.method, request.url.path, body))
        return _answer(request)

    async def drive() -> None:
        engine = SGLangEngine(
            SGLangEngineConfig(url="http://sglang:30000", snapshot_dir=str(folder)),
            transport=httpx.MockTransport(handler),
            lora=LORA,
        )
        for version in (1, 2):
            await engine.load_adapter(adapter_tensors(), version)
            await engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))
            await engine.generate([[3]], SamplingParams(max_new_tokens=1, n=2))
        await engine.close()

    asyncio.run(drive())
    return captured


@pytest.fixture(scope="module")
def adapter_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A version's adapter as the engine hands it to SGLang (loading it, answer captured)."""
    folders: list[Path] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/load_lora_adapter":
            folders.append(Path(json.loads(request.content)["lora_path"]))
        return _answer(request)

    engine = SGLangEngine(
        SGLangEngineConfig(snapshot_dir=str(tmp_path_factory.mktemp("w"))),
        transport=httpx.MockTransport(handler),
        lora=LORA,
    )
    asyncio.run(engine.load_adapter(adapter_tensors(), 1))  # not closed: the folder stays
    return folders[0]


@pytest.fixture(scope="module")
def attached() -> list[tuple[str, str, Any]]:
    """Every (method, path, body) of a LoRA job's replica starting on a server it did not launch,
    which lists a base model, an adapter an earlier replica left and one that is not kuberl's."""
    captured: list[tuple[str, str, Any]] = []
    cards = [
        {"id": "base", "object": "model", "root": "/models/m"},
        {
            "id": "kuberl-0dead0-v3",
            "object": "model",
            "root": "/w/kuberl-0dead0-v3",
            "parent": "base",
        },
        {"id": "someone-elses", "object": "model", "root": "/w/x", "parent": "base"},
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        captured.append((request.method, request.url.path, body))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": cards})
        return _answer(request)

    async def drive() -> None:
        engine = SGLangEngine(
            SGLangEngineConfig(url="http://sglang:30000"),
            transport=httpx.MockTransport(handler),
            lora=LORA,
        )
        await engine.start()
        await engine.close()

    asyncio.run(drive())
    return captured


def _sglang_module(relative: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, SGLANG / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _list_constant(relative: str, name: str) -> list[str]:
    tree = ast.parse((SGLANG / relative).read_text())
    node = next(
        n
        for n in tree.body
        if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == name for t in n.targets)
    )
    return list(ast.literal_eval(node.value))


# -- requests ---------------------------------------------------------------------------------


def test_the_lora_client_sends_only_routes_and_bodies_sglang_has(sent) -> None:
    assert (sorted({p for _, p, _ in sent}), _against_sglang(sent)) == (
        ["/generate", "/load_lora_adapter", "/unload_lora_adapter"],
        [],
    )


def test_the_lora_routes_bind_sglangs_adapter_request_classes(sent) -> None:
    routes = _routes()
    assert {p: routes[p][1] for _, p, _ in sent if p != "/generate"} == {
        "/load_lora_adapter": "LoadLoRAAdapterReqInput",
        "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
    }


def test_every_generate_names_a_loaded_adapter_and_decodes_with_sglangs_json_contract(
    sent,
) -> None:
    api = _api_types()
    loaded: set[str] = set()
    named = []
    for _, path, body in sent:
        if path == "/load_lora_adapter":
            loaded.add(body["lora_name"])
        elif path == "/unload_lora_adapter":
            loaded.discard(body["lora_name"])
        elif path == "/generate":
            api.GenerateRequest.from_json_value(body)
            named.append(body["lora_path"] in loaded)
    assert named == [True] * 6  # per version: one sample, a group's prefill and its samples


def test_each_version_has_an_adapter_name_and_folder_of_its_own(sent) -> None:
    loads = [b for _, p, b in sent if p == "/load_lora_adapter"]
    names, paths = [b["lora_name"] for b in loads], [b["lora_path"] for b in loads]
    assert (len(set(names)), len(set(paths)), all(Path(p).is_absolute() for p in paths)) == (
        2,
        2,
        True,
    )


def test_a_replaced_adapter_is_unloaded_and_the_last_one_on_close(sent) -> None:
    loads = [b["lora_name"] for _, p, b in sent if p == "/load_lora_adapter"]
    unloads = [b["lora_name"] for _, p, b in sent if p == "/unload_lora_adapter"]
    assert unloads == loads


def test_attaching_unloads_only_the_adapters_an_earlier_replica_left(attached) -> None:
    unloads = [b["lora_name"] for _, p, b in attached if p == "/unload_lora_adapter"]
    assert (unloads, _against_sglang(attached)) == (["kuberl-0dead0-v3"], [])


def test_sglang_lists_loaded_adapters_as_model_cards_with_a_parent() -> None:
    # What the start reads to find them: `available_models` adds one ModelCard per adapter in
    # the registry, its id the adapter's name and its parent the served model.
    source = (SGLANG / "srt/entrypoints/http_server.py").read_text()
    listing = ast.unparse(
        next(
            n
            for n in ast.parse(source).body
            if isinstance(n, ast.AsyncFunctionDef) and n.name == "available_models"
        )
    )
    protocol = ast.parse((SGLANG / "srt/entrypoints/openai/protocol.py").read_text())
    card = next(n for n in protocol.body if isinstance(n, ast.ClassDef) and n.name == "ModelCard")
    fields = {i.target.id for i in card.body if isinstance(i, ast.AnnAssign)}  # type: ignore[union-attr]
    assert '@app.get("/v1/models"' in source.replace("'", '"')
    assert "id=lora_ref.lora_name" in listing and "parent=served_model_names[0]" in listing
    assert {"id", "parent", "root"} <= fields


# -- launch flags -----------------------------------------------------------------------------


def test_lora_launch_flags_are_options_of_sglang_launch_server() -> None:
    cmd = launch_command(SGLangEngineConfig(), "/models/m", "127.0.0.1", 30000, LORA)
    flags = {arg for arg in cmd if arg.startswith("--")}
    assert {
        "--enable-lora",
        "--max-lora-rank",
        "--lora-target-modules",
        "--max-loras-per-batch",
    } <= flags
    assert flags - _launch_flags() == set()


def test_the_launch_gives_sglang_what_it_needs_to_take_adapters_loaded_later() -> None:
    # check_lora_server_args: with no --lora-paths, both the rank and the target modules must be
    # given, or the server refuses to start.
    hook = (SGLANG / "srt/arg_groups/lora_hook.py").read_text()
    cmd = launch_command(SGLangEngineConfig(), "/models/m", "127.0.0.1", 30000, LORA)
    rank = cmd[cmd.index("--max-lora-rank") + 1]
    targets = cmd[cmd.index("--lora-target-modules") + 1 : cmd.index("--max-loras-per-batch")]
    assert "assert cfg.lora_paths or (cfg.max_lora_rank and cfg.lora_target_modules)" in hook
    assert (rank, targets, "--lora-paths" in cmd) == (
        "8",
        list(DECODER_LINEAR_LAYERS),
        False,
    )


def test_kuberls_list_of_lora_target_modules_is_sglangs() -> None:
    supported = _list_constant("srt/utils/common.py", "SUPPORTED_LORA_TARGET_MODULES")
    fields = (SGLANG / "srt/arg_groups/fields/lora.py").read_text()
    assert "choices=SUPPORTED_LORA_TARGET_MODULES + [LORA_TARGET_ALL_MODULES]" in fields
    assert list(SGLANG_LORA_TARGET_MODULES) == supported


def test_the_batch_allows_two_adapters_and_the_default_is_larger() -> None:
    # A version's adapter and the one before it, whose last requests may still run.
    tree = ast.parse((SGLANG / "srt/arg_groups/fields/lora.py").read_text())
    default = next(
        n.value.value
        for n in ast.walk(tree)
        if isinstance(n, ast.AnnAssign)
        and getattr(n.target, "id", "") == "max_loras_per_batch"
        and isinstance(n.value, ast.Constant)
    )
    assert (LORA_ADAPTERS_PER_BATCH, default >= LORA_ADAPTERS_PER_BATCH) == (2, True)


# -- the adapter folder, read by SGLang's own code --------------------------------------------


def test_sglangs_lora_config_reads_the_folder_with_the_jobs_rank_and_targets(
    adapter_folder: Path,
) -> None:
    pytest.importorskip("huggingface_hub", reason="sglang's lora_config.py imports it")
    module = _sglang_module("srt/lora/lora_config.py", "sglang_lora_config_contract")
    config = module.LoRAConfig(str(adapter_folder), base_vocab_size=100)
    assert (
        config.r,
        config.lora_alpha,
        sorted(config.target_modules),
        config.use_dora,
        config.lora_added_tokens_size,
    ) == (8, 16, sorted(DECODER_LINEAR_LAYERS), False, 0)


def test_sglang_finds_each_weights_layer_and_kind_in_the_peft_names(adapter_folder: Path) -> None:
    from safetensors import safe_open

    source = (SGLANG / "srt/layers/utils/common.py").read_text()
    pattern = re.search(r're\.search\(r"(.+?)", weight_name\)', source)
    assert pattern is not None and pattern.group(1) == r"layers\.(\d+)\."
    with safe_open(str(adapter_folder / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    layers = {re.search(pattern.group(1), n).group(1) for n in names}  # type: ignore[union-attr]
    kinds = {("lora_A" in n) + 2 * ("lora_B" in n) for n in names}
    assert (layers, kinds, all(n.startswith("base_model.model.model.") for n in names)) == (
        {"0", "1"},
        {1, 2},
        True,
    )


# -- what the engine rests on -----------------------------------------------------------------


def test_a_refused_adapter_load_is_an_http_400_with_the_reason() -> None:
    # The engine maps 400 to EngineRejected (not retried) and reports the message.
    load = ast.unparse(
        next(
            n
            for n in ast.parse((SGLANG / "srt/entrypoints/http_server.py").read_text()).body
            if isinstance(n, ast.AsyncFunctionDef) and n.name == "load_lora_adapter"
        )
    )
    classes = (SGLANG / "srt/managers/io_struct.py").read_text()
    assert "HTTPStatus.OK if result.success else HTTPStatus.BAD_REQUEST" in load
    assert "error_message: Optional[str] = None" in classes


def test_sglang_unloads_an_adapter_only_after_its_requests_and_reloads_one_named_again() -> None:
    # Unload stops new requests from getting the adapter and waits for those under it; a
    # request naming an adapter once loaded but since unloaded makes SGLang load it again from
    # its path, which is why the engine never names a replaced adapter again.
    mixin = "srt/managers/tokenizer_control_mixin.py"
    unload = ast.unparse(_function(mixin, "TokenizerControlMixin", "_unload_lora_adapter_locked"))
    resolve = ast.unparse(
        _function("srt/managers/tokenizer_manager.py", "TokenizerManager", "_resolve_lora_path")
    )
    assert (
        unload.index("self.lora_registry.unregister") < unload.index("wait_for_unload"),
        "self.lora_ref_cache[lora_path]" in resolve and "self.load_lora_adapter(" in resolve,
    ) == (True, True)


def test_a_groups_prefill_names_its_samples_adapter_as_sglangs_own_prefill_does(sent) -> None:
    # SGLang's parallel sampling keeps the adapter on its prefill-only copy: the radix cache
    # keys a prefix by adapter, so a prefill under another adapter would not be found.
    source = (SGLANG / "srt/managers/tokenizer_manager.py").read_text()
    bodies = [b for _, p, b in sent if p == "/generate"]
    pairs = [
        (prefix["lora_path"], batch["lora_path"])
        for prefix, batch in itertools.pairwise(bodies)
        if str(prefix["rid"]).endswith("-prefix")
    ]
    assert "Keep LoRA on tokenized_obj for the correct prefix-cache key." in source
    assert len(pairs) == 2 and all(a == b for a, b in pairs)


def test_loading_an_adapter_leaves_sglangs_weight_version_alone() -> None:
    # So a LoRA job's versions are the adapters', stamped by the engine, not the server's.
    mixin = "srt/managers/tokenizer_control_mixin.py"
    loads = [
        ast.unparse(_function(mixin, "TokenizerControlMixin", name))
        for name in ("load_lora_adapter", "load_lora_adapter_from_tensors")
    ]
    assert [("weight_version" in code) for code in loads] == [False, False]


def test_the_stand_in_answers_adapter_routes_with_fields_of_sglangs_output_class(
    tmp_path: Path, adapter_folder: Path
) -> None:
    from tests.contract.test_sglang_contract import _io_struct
    from tests.integration.sglang_standin import SGLangStandIn

    fields = set(_io_struct()["LoRAUpdateOutput"])
    with SGLangStandIn(lora_max_rank=8, lora_target_modules=("all",)) as server:
        body = {"lora_name": "a", "lora_path": str(adapter_folder)}
        answers = [
            httpx.post(f"{server.url}/load_lora_adapter", json=body),
            httpx.post(f"{server.url}/load_lora_adapter", json=body),  # already loaded
            httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "a"}),
        ]
    assert [a.status_code for a in answers] == [200, 400, 200]
    assert all(set(a.json()) <= fields for a in answers)
