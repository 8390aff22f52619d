"""SGLang's own /update_weights_from_tensor consumer, run in isolation: the peer of the CUDA IPC
payload contract test.

SGLang cannot be imported here (the package pulls in CUDA-only dependencies), so this module
takes, from the installed sglang 0.5.23 source and unchanged, what its server runs on the bytes
of one `serialized_named_tensors` entry:

- from sglang/srt/utils/common.py, extracted with `ast` and compiled alone:
  `normalize_serialized_named_tensor_payload` (base64 to bytes, what the HTTP route does),
  `MultiprocessingSerializer` and `SafeUnpickler` (the allow-list of globals a payload may name)
  with `_safe_load_torch_storage`. `pybase64` is not installed here; the stdlib `base64` module,
  whose `b64decode(..., validate=True)` / `b64encode` it mirrors, stands in for it.
- from sglang/srt/utils/patch_torch.py: `monkey_patch_torch_reductions` and the functions it
  installs (the scheduler calls it before deserializing: a CUDA tensor's device may be a GPU
  UUID, mapped to the local index), with its NPU branch off.
- from sglang/srt/model_executor/model_runner_components/weight_updater.py: the methods
  `WeightUpdater.update_weights_from_tensor` and `_update_weights_from_flattened_bucket`, called
  with a stand-in `self` whose model records what `load_weights` is given (the derived-weight
  cache check, which imports SGLang kernels, is replaced by "no such cache").
- sglang/srt/weight_sync/tensor_bucket.py (imports only torch), loaded by path.

`load(bodies)` does what the scheduler does for each request body (`deserialize_own_rank` for
tp rank 0, then the model runner's update) and returns the tensors loaded, by name, in order, and
every global the unpickler was asked for; it undoes SGLang's patch of torch's reductions when
done. Run as `python -m tests.contract.sglang_tensor_peer
BODIES OUT` (BODIES: a JSON list of request bodies; OUT: a .safetensors file of what was loaded,
plus OUT.globals.json). No kuberl code is imported here.
"""

from __future__ import annotations
import __future__

import ast
import base64
import binascii
import io
import json
import pickle
import sys
from collections.abc import Callable, Iterable
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Union

import torch
from torch.multiprocessing import reductions

from tests.contract.sglang_weight_peer import load_flattened_tensor_bucket, sglang_root


def _compile(path: Path, nodes: list[ast.stmt], namespace: dict[str, Any]) -> dict[str, Any]:
    """Run `nodes` of `path` in `namespace` as that module would (its `from __future__ import
    annotations` included: annotations stay unevaluated)."""
    module = ast.Module(body=nodes, type_ignores=[])
    flags = __future__.annotations.compiler_flag
    exec(compile(module, str(path), "exec", flags=flags, dont_inherit=True), namespace)
    return namespace


def _top_level(tree: ast.Module, names: Iterable[str]) -> list[ast.stmt]:
    """The module-level definitions (functions, classes, assignments) of `names`, in file order."""
    wanted = set(names)
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in wanted:
            found.append(node)
            wanted.discard(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id in wanted:
                    found.append(node)
                    wanted.discard(t.id)
    if wanted:
        raise LookupError(f"not found in SGLang's source: {sorted(wanted)}")
    return found


def load_serializer(root: Path) -> dict[str, Any]:
    """SGLang's `MultiprocessingSerializer`, `SafeUnpickler` and
    `normalize_serialized_named_tensor_payload`, compiled from sglang/srt/utils/common.py."""
    path = root / "srt/utils/common.py"
    nodes = _top_level(
        ast.parse(path.read_text()),
        [
            "MultiprocessingSerializer",
            "SerializedTensorPayload",
            "_looks_like_pickle_payload",
            "normalize_serialized_named_tensor_payload",
            "_safe_load_torch_storage",
            "SafeUnpickler",
        ],
    )
    namespace: dict[str, Any] = {
        "io": io,
        "pickle": pickle,
        "binascii": binascii,
        "torch": torch,
        "pybase64": base64,
        "ForkingPickler": ForkingPickler,
        "Union": Union,  # SerializedTensorPayload = Union[...]
    }
    return _compile(path, nodes, namespace)


def load_reduction_patch(root: Path) -> dict[str, Any]:
    """SGLang's `monkey_patch_torch_reductions` (and what it installs), from
    sglang/srt/utils/patch_torch.py, for CUDA (not NPU)."""
    path = root / "srt/utils/patch_torch.py"
    nodes = _top_level(
        ast.parse(path.read_text()),
        [
            "monkey_patch_torch_reductions",
            "_REDUCE_TENSOR_ARG_DEVICE_INDEX",
            "_reduce_tensor_modified",
            "_rebuild_cuda_tensor_modified",
            "_device_to_uuid",
            "_device_from_maybe_uuid",
            "_modify_tuple",
        ],
    )
    namespace: dict[str, Any] = {"torch": torch, "reductions": reductions, "_is_npu": False}
    return _compile(path, nodes, namespace)


def load_tensor_update(root: Path, patch: dict[str, Any]) -> dict[str, Any]:
    """`WeightUpdater.update_weights_from_tensor` and `_update_weights_from_flattened_bucket`,
    compiled as functions taking `self` first."""
    path = root / "srt/model_executor/model_runner_components/weight_updater.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WeightUpdater")
    wanted = {"update_weights_from_tensor", "_update_weights_from_flattened_bucket"}
    methods: list[ast.stmt] = [
        n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in wanted
    ]
    if len(methods) != len(wanted):
        raise LookupError(f"WeightUpdater lacks one of {sorted(wanted)}")
    buckets = sys.modules[load_flattened_tensor_bucket(root).__module__]
    namespace: dict[str, Any] = {
        "torch": torch,
        "monkey_patch_torch_reductions": patch["monkey_patch_torch_reductions"],
        "FlattenedTensorBucket": buckets.FlattenedTensorBucket,
        "FlattenedTensorMetadata": buckets.FlattenedTensorMetadata,
        "_unsupported_derived_weight_cache_error": lambda model=None: None,
    }
    return _compile(path, methods, namespace)


class _Model:
    """Records what SGLang's updater hands `load_weights` (a copy: the payload's memory goes
    back to its producer once the update returns)."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.loaded.extend((name, t.detach().to("cpu", copy=True)) for name, t in weights)


def load(
    bodies: list[dict[str, Any]], replace: Callable[[str, str, Any], Any] | None = None
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, str]]]:
    """What SGLang's scheduler and model runner do for each /update_weights_from_tensor body
    (tp rank 0): the tensors given to the model's `load_weights` and the globals the payloads
    named. `replace(module, name, found)`, if given, returns what to use for a global SGLang's
    unpickler admitted (to record a call that needs a GPU where there is none)."""
    root = sglang_root()
    assert root is not None
    serializer = load_serializer(root)
    patch = load_reduction_patch(root)
    update = load_tensor_update(root, patch)
    asked: list[tuple[str, str]] = []

    class RecordingUnpickler(serializer["SafeUnpickler"]):  # type: ignore[misc, name-defined]
        def find_class(self, module: str, name: str) -> Any:
            asked.append((module, name))
            found = super().find_class(module, name)  # SGLang's allow-list decides
            return replace(module, name, found) if replace is not None else found

    serializer["SafeUnpickler"] = RecordingUnpickler  # what MultiprocessingSerializer calls
    model = _Model()
    # A model runner's WeightUpdater with SGLang's two methods, its model replaced by a recorder.
    runner_class = type(
        "WeightUpdater",
        (),
        {
            "update_weights_from_tensor": update["update_weights_from_tensor"],
            "_update_weights_from_flattened_bucket": update[
                "_update_weights_from_flattened_bucket"
            ],
            "get_model": lambda self: model,
            "_assert_weight_cache_inactive": lambda self, op: None,
            "custom_weight_loaders": {},
        },
    )
    runner = runner_class()
    try:
        for body in bodies:
            data = serializer["normalize_serialized_named_tensor_payload"](
                body["serialized_named_tensors"][0]
            )
            # TpModelWorker.deserialize_own_rank
            patch["monkey_patch_torch_reductions"]()
            named_tensors = serializer["MultiprocessingSerializer"].deserialize(data)
            ok, message = runner.update_weights_from_tensor(
                named_tensors=named_tensors, load_format=body.get("load_format")
            )
            if not ok:
                raise RuntimeError(f"SGLang's update refused the payload: {message}")
            del named_tensors  # releases the producer's memory, as the scheduler does on return
    finally:
        _unpatch()
    return model.loaded, asked


def _unpatch() -> None:
    """Undo SGLang's patch of torch's reductions, leaving the calling process as it was."""
    if hasattr(reductions, "_reduce_tensor_original"):
        reductions.reduce_tensor = reductions._reduce_tensor_original
        reductions.rebuild_cuda_tensor = reductions._rebuild_cuda_tensor_original
        del reductions._reduce_tensor_original, reductions._rebuild_cuda_tensor_original
        reductions.init_reductions()


if __name__ == "__main__":
    from safetensors.torch import save_file

    bodies_file, out = Path(sys.argv[1]), Path(sys.argv[2])
    loaded, asked = load(json.loads(bodies_file.read_text()))
    save_file(dict(loaded), str(out))
    Path(f"{out}.globals.json").write_text(
        json.dumps({"order": [n for n, _ in loaded], "globals": sorted(set(asked))})
    )
