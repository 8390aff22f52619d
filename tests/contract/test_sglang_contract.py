"""Every HTTP request the `sglang` engine sends, checked against SGLang 0.5.23's own source.

SGLang cannot run here and its request classes cannot be imported without its dependencies
(`import sglang.srt.managers.io_struct` stops at `sglang/srt/utils/common.py` importing
orjson, and behind it wait a CUDA torch and its kernel packages), so this test reads the pinned
package's source (`pip install --no-deps sglang==0.5.23`) with `ast`: the routes and HTTP methods of
`srt/entrypoints/http_server.py`, the request class each route binds, that class's fields in
`srt/managers/io_struct.py` (which are required, which have defaults), and the launch_server
flags of `srt/arg_groups/fields/`. The client is driven through every method, each request it
sends is captured, and its route, method and body are checked against those. Where `msgspec` is
installed, the generated JSON contract of SGLang's HTTP API (`sglang/api/v1/api_types.py`, plain
Python with no other dependency) also decodes every /generate body — it rejects unknown sampling
parameters — and the stand-in server's /generate answers. Without the package every test skips.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import importlib.metadata
import importlib.util
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from kuberl.common.config import SGLangEngineConfig
from kuberl.rollout.engine.base import SamplingParams
from kuberl.rollout.engine.sglang import SGLANG_VERSION, SGLangEngine, launch_command

_spec = importlib.util.find_spec("sglang")
SGLANG = (
    Path(_spec.submodule_search_locations[0])
    if _spec and _spec.submodule_search_locations
    else None
)
pytestmark = pytest.mark.skipif(
    SGLANG is None,
    reason=f"sglang is not installed; run `.venv/bin/pip install --no-deps "
    f"sglang=={SGLANG_VERSION}` to check the client against its source",
)


# -- what SGLang's source declares ------------------------------------------------------------


def _routes() -> dict[str, tuple[set[str], str | None]]:
    """path -> (HTTP methods, name of the request class the handler binds as `obj`)."""
    tree = ast.parse((SGLANG / "srt/entrypoints/http_server.py").read_text())
    routes: dict[str, tuple[set[str], str | None]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        cls = None
        for arg in node.args.args:
            if arg.arg == "obj" and arg.annotation is not None:
                ann = arg.annotation
                if isinstance(ann, ast.Subscript):  # Annotated[Cls, Body()]
                    ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
                cls = ann.id if isinstance(ann, ast.Name) else None
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
                continue
            if not (isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"):
                continue
            if not dec.args or not isinstance(dec.args[0], ast.Constant):
                continue
            path = dec.args[0].value
            if dec.func.attr in ("get", "post", "put", "delete"):
                methods = {dec.func.attr.upper()}
            elif dec.func.attr == "api_route":
                kw = {k.arg: k.value for k in dec.keywords}
                methods = {e.value for e in kw["methods"].elts} if "methods" in kw else {"GET"}
            else:
                continue
            old = routes.get(path, (set(), None))
            routes[path] = (old[0] | methods, cls or old[1])
    return routes


def _fields_of(tree: ast.Module) -> dict[str, dict[str, bool]]:
    """class -> {field: required}, following base classes defined in the same module."""
    own: dict[str, dict[str, bool]] = {}
    bases: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            fields = {}
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    fields[item.target.id] = item.value is None
            own[node.name] = fields
            bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def resolve(name: str) -> dict[str, bool]:
        out: dict[str, bool] = {}
        for base in bases.get(name, []):
            out.update(resolve(base))
        out.update(own.get(name, {}))
        return out

    return {name: resolve(name) for name in own}


def _io_struct() -> dict[str, dict[str, bool]]:
    return _fields_of(ast.parse((SGLANG / "srt/managers/io_struct.py").read_text()))


def _sampling_params_fields() -> set[str]:
    tree = ast.parse((SGLANG / "srt/sampling/sampling_params.py").read_text())
    return set(_fields_of(tree)["SamplingParams"])


def _launch_flags() -> set[str]:
    flags = set()
    for path in (SGLANG / "srt/arg_groups/fields").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                flags.add("--" + node.target.id.replace("_", "-"))
    return flags


def _api_types() -> Any:
    """SGLang's generated JSON contract module, loaded by path (it needs only msgspec)."""
    pytest.importorskip("msgspec", reason="msgspec is needed to load sglang/api/v1/api_types.py")
    name = "sglang_api_types_contract"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SGLANG / "api/v1/api_types.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# -- what the client sends --------------------------------------------------------------------


def _answer(request: httpx.Request) -> httpx.Response:
    path = request.url.path
    if path == "/generate":
        body = json.loads(request.content)
        rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
        n = body["sampling_params"].get("n", 1)
        items = [
            {
                "text": "",
                "output_ids": [5],
                "meta_info": {
                    "id": rid,
                    "finish_reason": {"type": "length", "length": 1},
                    "output_token_logprobs": [[-0.5, 5, None]],
                    "weight_version": "0",
                },
            }
            for rid in rids * n
        ]
        single = isinstance(body["rid"], str) and n == 1
        return httpx.Response(200, json=items[0] if single else items)
    if path in ("/health_generate", "/abort_request", "/flush_cache"):
        return httpx.Response(200, text="")
    return httpx.Response(200, json={"success": True, "message": "ok"})


def _instruction() -> Any:
    from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
    from kuberl.common.weights import ManifestBuilder

    builder = ManifestBuilder(bucket_bytes=1024)
    builder.add("model.embed_tokens.weight", "bfloat16", [100, 4])
    builder.add("model.norm.weight", "float32", [4])
    builder.add("lm_head.weight", "bfloat16", [100, 4])
    return pb.UpdateInstruction(
        version=3,
        transport=pb.TRANSPORT_NCCL,
        manifest=builder.build().to_proto(),
        group=pb.BroadcastGroup(
            group_name="kuberl-v3",
            backend="nccl",
            master_address="10.0.0.1",
            master_port=29500,
            world_size=3,
        ),
        rank=1,
    )


def _cuda_ipc_instruction() -> Any:
    from kuberl.common.weights import plan
    from tests.contract.test_sglang_tensor_update import cuda_ipc_instruction

    manifest = plan([("w", "bfloat16", [300, 4]), ("b", "float32", [4])], bucket_bytes=1024)
    return cuda_ipc_instruction(manifest)


DROPPED = 9  # the prompt whose first /generate loses its connection in `sent`


@pytest.fixture(scope="module")
def sent() -> list[tuple[str, str, Any]]:
    """Every (method, path, body) the client sends while each of its methods is used once."""
    captured: list[tuple[str, str, Any]] = []
    dropped: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        captured.append((request.method, request.url.path, body))
        if request.url.path == "/generate" and body["input_ids"] == [DROPPED] and not dropped:
            dropped.append(body)
            raise httpx.ReadError("connection dropped mid-request", request=request)
        return _answer(request)

    async def drive() -> None:
        engine = SGLangEngine(
            SGLangEngineConfig(url="http://sglang:30000", retry_backoff_seconds=0),
            transport=httpx.MockTransport(handler),
        )
        await engine.health()
        await engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=4))
        await engine.generate(
            [[1, 2], [3]],
            SamplingParams(
                temperature=0.7,
                top_p=0.9,
                top_k=20,
                max_new_tokens=8,
                stop=("</tool_call>",),
                stop_token_ids=(7,),
                n=4,
            ),
        )
        # ignore_eos apart: with stop ids the client refuses it (SGLang would ignore the ids).
        await engine.generate([[4]], SamplingParams(max_new_tokens=2, ignore_eos=True))
        await engine.generate([[DROPPED]], SamplingParams(max_new_tokens=2))  # retried
        await engine.pause("abort")
        await engine.pause("in_place")
        await engine.resume()
        await engine.abort_all()
        await engine._abort_live({"kuberl-x-1"})
        await engine.flush_cache()
        await engine.update_weights_from_disk("/snapshots/v2", version=2)
        await engine.init_weights_update_group("10.0.0.1", 29500, 1, 2, "g", "nccl")
        await engine.begin_weight_update()
        await engine.update_weights_from_distributed(
            ["w"], ["bfloat16"], [[2, 2]], version=3, group_name="g"
        )
        await engine.update_weights_from_distributed(
            ["w"], ["bfloat16"], [[2, 2]], 3, "g", load_format="flattened_bucket"
        )
        await engine.end_weight_update()
        await engine.destroy_weights_update_group("g")
        await engine.update_weights_from_tensor(["YWJj"], version=4, load_format="direct")
        await engine.apply_broadcast(_instruction())
        await engine.apply_cuda_ipc(_cuda_ipc_instruction())
        await engine.close()

    asyncio.run(drive())
    return captured


@pytest.fixture(scope="module")
def attached() -> list[tuple[str, str, Any]]:
    """Every (method, path, body) a replica sends when it starts on a server it did not launch
    (one a replica that died mid-update may have left paused, inside an update session)."""
    captured: list[tuple[str, str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        captured.append((request.method, request.url.path, body))
        return _answer(request)

    async def drive() -> None:
        engine = SGLangEngine(
            SGLangEngineConfig(url="http://sglang:30000"), transport=httpx.MockTransport(handler)
        )
        await engine.start()
        await engine.close()

    asyncio.run(drive())
    return captured


def _against_sglang(requests: list[tuple[str, str, Any]]) -> list[str]:
    """What in these requests SGLang's source does not have: a route or method, a body key that
    is no field of the route's request class, a required field left out."""
    routes, classes = _routes(), _io_struct()
    problems = []
    for method, path, body in requests:
        if path not in routes or method not in routes[path][0]:
            problems.append(f"{method} {path}: no such route")
            continue
        cls = routes[path][1]
        if body is None:
            continue
        if cls is None:
            problems.append(f"{path}: sglang binds no request class but we send a body")
            continue
        fields = classes[cls]
        unknown = sorted(set(body) - set(fields))
        missing = sorted(f for f, required in fields.items() if required and f not in body)
        if unknown or missing:
            problems.append(f"{path} ({cls}): unknown {unknown}, missing required {missing}")
    return problems


def _function(path: str, cls: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    tree = ast.parse((SGLANG / path).read_text())
    owner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(
        n
        for n in owner.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
    )


def test_the_installed_sglang_is_the_pinned_version() -> None:
    assert importlib.metadata.version("sglang") == SGLANG_VERSION


def test_the_client_was_driven_through_every_route_it_knows(sent) -> None:
    used = {path for _, path, _ in sent}
    assert used == {
        "/health_generate",
        "/generate",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/flush_cache",
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
    }


def test_every_route_and_method_exists_in_sglang_http_server(sent) -> None:
    routes = _routes()
    wrong = sorted(
        {
            f"{method} {path}"
            for method, path, _ in sent
            if path not in routes or method not in routes[path][0]
        }
    )
    assert wrong == []


def test_every_body_uses_only_fields_of_the_request_class_of_its_route(sent) -> None:
    routes, classes = _routes(), _io_struct()
    problems = []
    for _, path, body in sent:
        cls = routes[path][1]
        if body is None:
            continue
        assert cls is not None, f"{path}: sglang binds no request class but we send a body"
        fields = classes[cls]
        unknown = sorted(set(body) - set(fields))
        missing = sorted(f for f, required in fields.items() if required and f not in body)
        if unknown or missing:
            problems.append(f"{path} ({cls}): unknown {unknown}, missing required {missing}")
    assert problems == []


def test_the_routes_bind_the_request_classes_we_expect(sent) -> None:
    routes = _routes()
    assert {path: routes[path][1] for _, path, _ in sent} == {
        "/health_generate": None,
        "/generate": "GenerateReqInput",
        "/pause_generation": "PauseGenerationReqInput",
        "/continue_generation": "ContinueGenerationReqInput",
        "/abort_request": "AbortReq",
        "/flush_cache": None,
        "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
        "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
        "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
        "/begin_weight_update": "BeginWeightUpdateReqInput",
        "/end_weight_update": "EndWeightUpdateReqInput",
        "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
        "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    }


def test_sampling_params_are_arguments_of_sglang_sampling_params(sent) -> None:
    accepted = _sampling_params_fields()
    used = {k for _, path, body in sent if path == "/generate" for k in body["sampling_params"]}
    assert used - accepted == set()


def test_pause_modes_are_modes_sglang_accepts(sent) -> None:
    tree = ast.parse((SGLANG / "srt/managers/io_struct.py").read_text())
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PauseGenerationReqInput"
    )
    mode = next(i for i in cls.body if isinstance(i, ast.AnnAssign) and i.target.id == "mode")
    allowed = {e.value for e in mode.annotation.slice.elts}  # Literal["abort", ...]
    assert {body["mode"] for _, path, body in sent if path == "/pause_generation"} <= allowed


def test_generate_bodies_decode_with_sglangs_json_contract(sent) -> None:
    api = _api_types()
    bodies = [body for _, path, body in sent if path == "/generate"]
    decoded = [api.GenerateRequest.from_json_value(body) for body in bodies]
    sampled = [d for b, d in zip(bodies, decoded, strict=True) if "-prefix" not in str(b["rid"])]
    assert [d.return_logprob for d in sampled] == [True] * (len(bodies) - 2)  # 2 prefill-only


def test_an_unknown_sampling_parameter_would_be_caught_by_that_contract() -> None:
    api = _api_types()
    with pytest.raises(api.JsonContractError, match="unknown field `temprature`"):
        api.GenerateRequest.from_json_value(
            {"input_ids": [1], "sampling_params": {"temprature": 1}}
        )


def test_the_stand_in_answers_generate_in_sglangs_response_schema() -> None:
    from tests.integration.sglang_standin import SGLangStandIn

    api = _api_types()
    with SGLangStandIn() as server:
        one = httpx.post(
            f"{server.url}/generate",
            json={
                "input_ids": [1, 2],
                "sampling_params": {"max_new_tokens": 3},
                "return_logprob": True,
            },
        ).json()
        many = httpx.post(
            f"{server.url}/generate",
            json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, "n": 2}},
        ).json()
    responses = [api.GenerateResponse.from_json_value(x) for x in [one, *many]]
    assert [len(r.meta_info.output_token_logprobs) for r in responses] == [
        len(r.output_ids) for r in responses
    ]


def test_launch_flags_are_options_of_sglang_launch_server() -> None:
    cmd = launch_command(SGLangEngineConfig(), "/models/m", "127.0.0.1", 30000)
    flags = {arg for arg in cmd if arg.startswith("--")}
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert (SGLANG / "launch_server.py").exists()
    assert flags - _launch_flags() == set()


def test_cuda_ipc_bodies_give_each_field_of_update_weights_from_tensor_its_declared_type(
    sent,
) -> None:
    tree = ast.parse((SGLANG / "srt/managers/io_struct.py").read_text())
    cls = next(
        n
        for n in tree.body
        if isinstance(n, ast.ClassDef) and n.name == "UpdateWeightsFromTensorReqInput"
    )
    declared = {
        i.target.id: ast.unparse(i.annotation)
        for i in cls.body
        if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)
    }
    # How each declared type arrives in JSON (bytes fields as base64 strings: Base64Bytes).
    accepts = {
        "Annotated[List[bytes], Base64Bytes()]": lambda v: isinstance(v, list)
        and all(isinstance(x, str) and base64.b64decode(x, validate=True) for x in v),
        "Optional[str]": lambda v: v is None or isinstance(v, str),
        "bool": lambda v: isinstance(v, bool),
    }
    bodies = [b for _, path, b in sent if path == "/update_weights_from_tensor"]
    wrong = [
        (key, declared[key])
        for body in bodies
        for key, value in body.items()
        if not accepts[declared[key]](value)
    ]
    assert (len(bodies) > 2, wrong) == (True, [])


def test_attaching_to_a_running_server_sends_only_routes_and_bodies_sglang_has(attached) -> None:
    assert ([p for _, p, _ in attached], _against_sglang(attached)) == (
        ["/end_weight_update", "/continue_generation", "/health_generate"],
        [],
    )


def test_the_recovery_calls_bind_the_session_and_continue_request_classes(attached) -> None:
    routes = _routes()
    assert {p: routes[p][1] for _, p, _ in attached if p != "/health_generate"} == {
        "/end_weight_update": "EndWeightUpdateReqInput",
        "/continue_generation": "ContinueGenerationReqInput",
    }


def test_sglang_gives_parallel_samples_fresh_rids_after_a_prefill_only_copy() -> None:
    # What the group path rests on: 0.5.23 runs n > 1 as a max_new_tokens = 0 copy of the prompt
    # (awaited) and then n requests under `regenerate_rid()`, a bare uuid4 that keeps nothing of
    # the rid we sent, so an abort naming our rid reaches none of them. The client sends those
    # two steps itself, with its own rids; if SGLang changes this, re-read it.
    handler = ast.unparse(
        _function("srt/managers/tokenizer_manager.py", "TokenizerManager", "_handle_batch_request")
    )
    regenerate = ast.unparse(
        _function("srt/managers/io_struct.py", "GenerateReqInput", "regenerate_rid")
    )
    assert (
        handler.count("tokenized_obj.rid = tmp_obj.regenerate_rid()"),
        "tokenized_obj.sampling_params.max_new_tokens = 0" in handler,
        "uuid.uuid4().hex" in regenerate and "self.rid}" not in regenerate,
    ) == (2, True, True)


def test_sglang_aborts_only_a_rid_it_holds_and_then_every_rid_it_prefixes() -> None:
    # Why each sample of a group is aborted by its own rid, and why no rid may prefix another:
    # the tokenizer manager forwards an abort only for a rid in its table, the scheduler then
    # aborts every request whose rid starts with it.
    tokenizer = ast.unparse(
        _function("srt/managers/tokenizer_manager.py", "TokenizerManager", "abort_request")
    )
    scheduler = ast.unparse(_function("srt/managers/scheduler.py", "Scheduler", "abort_request"))
    assert (
        "self.rid_to_state.get(rid)" in tokenizer,
        "req.rid.startswith(recv_req.rid)" in scheduler,
    ) == (True, True)


def test_a_group_goes_out_as_a_prefill_only_request_then_a_batch_with_a_rid_per_sample(
    sent,
) -> None:
    bodies = [b for _, p, b in sent if p == "/generate" and isinstance(b["input_ids"][0], list)]
    prefixes = [b for _, p, b in sent if p == "/generate" and "-prefix" in str(b["rid"])]
    assert [(len(b["rid"]), len(set(b["rid"])), b["sampling_params"]["n"]) for b in bodies] == [
        (4, 4, 1),
        (4, 4, 1),
    ]
    assert [b["sampling_params"] for b in prefixes] == [{"max_new_tokens": 0}] * 2


def test_every_generate_rid_is_new_and_none_is_a_prefix_of_another(sent) -> None:
    # SGLang refuses a rid it still holds, and its abort matches by prefix.
    rids = [
        r
        for _, p, b in sent
        if p == "/generate"
        for r in (b["rid"] if isinstance(b["rid"], list) else [b["rid"]])
    ]
    ordered = sorted(set(rids))
    prefixes = [(a, b) for a, b in itertools.pairwise(ordered) if b.startswith(a)]
    assert (len(ordered), prefixes) == (len(rids), [])


def test_a_retried_generate_aborts_the_dropped_attempt_then_goes_out_under_a_new_rid(sent) -> None:
    at = [i for i, (_, p, b) in enumerate(sent) if p == "/generate" and b["input_ids"] == [DROPPED]]
    calls = [(p, b["rid"]) for _, p, b in sent[at[0] : at[-1] + 1]]
    dropped, retry = calls[0][1], calls[-1][1]
    assert (calls, dropped != retry) == (
        [("/generate", dropped), ("/abort_request", dropped), ("/generate", retry)],
        True,
    )


def test_sglang_refuses_a_rid_it_holds_until_the_request_ends_or_a_gone_client_is_aborted() -> None:
    # Why each attempt of a /generate has rids of its own: `_init_req_state` refuses a rid still
    # in rid_to_state (a ValueError, which the /generate route answers with 400), and a request
    # whose client hung up keeps its rid until the poll for gone clients aborts it.
    init = ast.unparse(
        _function("srt/managers/tokenizer_manager.py", "TokenizerManager", "_init_req_state")
    )
    wait = ast.unparse(
        _function("srt/managers/tokenizer_manager.py", "TokenizerManager", "_stream_one_response")
    )
    http = (SGLANG / "srt/entrypoints/http_server.py").read_text()
    assert (
        "if rid in self.rid_to_state or rid in rids:" in init,
        "raise ValueError(f'Duplicate request ID detected: {rid}')" in init,
        "except ValueError as e:" in http and "return _create_error_response(e)" in http,
        'status_code=getattr(e, "status_code", HTTPStatus.BAD_REQUEST)' in http,
        "await request.is_disconnected()" in wait and "self.abort_request(obj.rid)" in wait,
    ) == (True,) * 5
