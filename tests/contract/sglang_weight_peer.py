"""SGLang's own weight-update group code, run in isolation: the peer of the broadcast contract test.

SGLang cannot be imported here (the package pulls in CUDA-only dependencies), so this module
takes the two pieces of SGLang 0.5.23 that its server runs when it joins a weight-update group,
from the installed package's source, unchanged:

- `init_custom_process_group` (sglang/srt/utils/common.py), extracted with `ast` and compiled on
  its own, with the one module-level name it reads (`torch_release`, also taken from that file)
  and the imports that name needs (`torch`, `packaging.version`); the function imports what it
  uses from torch.distributed itself. SGLang's /init_weights_update_group calls it with
  `init_method="tcp://<master_address>:<master_port>"`, `rank = rank_offset + tp_rank`.
- `FlattenedTensorBucket` (sglang/srt/weight_sync/tensor_bucket.py, which imports only torch),
  loaded by path: what /update_weights_from_distributed with `load_format="flattened_bucket"`
  allocates and broadcasts into.

Run as `python -m tests.contract.sglang_weight_peer join|host REQUESTS OUT` (REQUESTS: the JSON
bodies of SGLang's HTTP API, OUT: a .safetensors file of what it received, or, for `host`, the
tensors to send). `join` is an SGLang server at rank 1 of a group someone else hosts (the relay),
doing what `WeightUpdater.init_weights_update_group` and `receive_weights_from_distributed` do;
`host` is rank 0 of a group, as RL trainers that drive SGLang (verl, slime) call the same
function. No kuberl code is imported here.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch


def sglang_root() -> Path | None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0])


def load_init_custom_process_group(root: Path) -> Any:
    """SGLang's `init_custom_process_group`, compiled alone from its source file."""
    path = root / "srt/utils/common.py"
    tree = ast.parse(path.read_text())
    function = next(
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "init_custom_process_group"
    )
    release = next(
        node
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "torch_release" for t in node.targets)
    )
    from packaging import version as pkg_version

    namespace: dict[str, Any] = {"torch": torch, "pkg_version": pkg_version}
    module = ast.Module(body=[release, function], type_ignores=[])
    exec(compile(module, str(path), "exec"), namespace)  # SGLang's code, as shipped
    return namespace["init_custom_process_group"]


def load_flattened_tensor_bucket(root: Path) -> Any:
    path = root / "srt/weight_sync/tensor_bucket.py"
    spec = importlib.util.spec_from_file_location("sglang_tensor_bucket_contract", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks the module up while building classes
    spec.loader.exec_module(module)
    return module.FlattenedTensorBucket


def join(requests: dict[str, Any], out: Path) -> None:
    """An SGLang server (tp_rank 0) taking one version: init group, one receive per bucket."""
    from safetensors.torch import save_file

    root = sglang_root()
    assert root is not None
    init_custom_process_group = load_init_custom_process_group(root)
    bucket_class = load_flattened_tensor_bucket(root)
    init = requests["init"]
    print("joining", flush=True)
    group = init_custom_process_group(
        backend=init["backend"],
        init_method=f"tcp://{init['master_address']}:{init['master_port']}",
        world_size=init["world_size"],
        rank=init["rank_offset"] + 0,
        group_name=init["group_name"],
    )
    received: dict[str, torch.Tensor] = {}
    for body in requests["updates"]:
        assert body["load_format"] == "flattened_bucket"
        assert body["group_name"] == init["group_name"]
        bucket = bucket_class.empty(body["names"], body["dtypes"], body["shapes"], "cpu")
        torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
        received.update((name, t.clone()) for name, t in bucket.reconstruct_tensors())
    torch.distributed.destroy_process_group(group)
    save_file(received, str(out))


def host(requests: dict[str, Any], tensors: Path) -> None:
    """Rank 0 of a group made with SGLang's function, sending the buckets `updates` name."""
    from safetensors.torch import load_file

    root = sglang_root()
    assert root is not None
    init_custom_process_group = load_init_custom_process_group(root)
    bucket_class = load_flattened_tensor_bucket(root)
    named = load_file(str(tensors))
    init = requests["init"]
    group = init_custom_process_group(
        backend=init["backend"],
        init_method=f"tcp://{init['master_address']}:{init['master_port']}",
        world_size=init["world_size"],
        rank=0,
        group_name=init["group_name"],
    )
    for body in requests["updates"]:
        bucket = bucket_class(named_tensors=[(name, named[name]) for name in body["names"]])
        torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
    torch.distributed.destroy_process_group(group)


if __name__ == "__main__":
    mode, requests_file, path = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    {"join": join, "host": host}[mode](json.loads(requests_file.read_text()), path)
