"""Weight-sync clients shared by the trainer and the rollout service (`kuberl.common.weights`).

The weight-sync service (`kuberl.weight_sync`) moves each policy version from the trainer to an
elastic pool of rollout engines. Services never import each other, so both ends of that service
live here. The API below is stable; see docs/weight-sync.md for the design.

Trainer (after the optimizer step, rank 0 or whichever rank holds the gathered parameters)::

    from kuberl.common.weights import WeightPublisher, VersionConflict

    publisher = WeightPublisher(config.endpoints.weight_sync)       # host:port of the service
    result = publisher.publish(version, named_tensors)              # Iterable[(str, Tensor)]
    # named_tensors is consumed lazily, one tensor at a time: yield ZeRO-3-gathered parameters
    # bucket by bucket (e.g. inside deepspeed.zero.GatheredParameters) and drop each after the
    # yield. GPU tensors are copied to the host one at a time. Returns once the service has the
    # bytes (shm on the same host, else a CRC32C-checked gRPC upload), never waiting for engines.
    # result: PublishResult(version, transport, total_bytes, num_tensors, seconds, engine_ids).
    # A version <= the latest published raises VersionConflict (FAILED_PRECONDITION).
    publisher.current_version()                                      # latest complete version

    # Colocated engines (same host and GPU) can also get the version by CUDA IPC, device to
    # device: offer it and name the GPU. When the service counts such engines, publish also packs
    # the version into GPU buckets (one more copy in GPU memory, kept until the next publish)
    # and commits one set of JSON handles per engine; the host copy still goes to the service.
    publisher = WeightPublisher(address, transports=("cuda_ipc", "shm", "snapshot"),
                                device="cuda:0")

Rollout engine (torch engine: tensors arrive in this process)::

    from kuberl.common.weights import EngineClient

    def load(tensors: dict[str, torch.Tensor], version: int) -> None:
        model.load_state_dict(tensors, strict=False)   # swap everything at once; the dict holds
                                                       # the whole version, views of one buffer
    # The buffer is one of two the client reuses (double buffering): the views stay valid until
    # the version after next is received, so an engine may serve from them directly if it
    # switches to each new dict when it is loaded; one that copies (as above) needs nothing.
    client = EngineClient(config.endpoints.weight_sync, load=load,
                          endpoint=my_rollout_grpc_address,   # for NotifyWeightsUpdate pushes
                          transports=("shm", "gloo", "snapshot"), device="cpu")
    # on a GPU: transports=("cuda_ipc", "nccl", "shm", "gloo", "snapshot"), device="cuda:0";
    # tensors then arrive on that GPU (cuda_ipc: from the trainer on the same GPU; nccl: from the
    # relay's GPU, `weight_sync.device`)
    current = client.start()          # register + background heartbeat (long poll) + receiver
    client.wait_for_version(current, timeout=300)   # catch up before taking prompts
    client.version                    # the version loaded now: stamp it on every trajectory
    client.submit(instruction)        # from RolloutService.NotifyWeightsUpdate (best effort;
                                      # returns False for a version not newer than held/queued)
    client.stop()                     # leave the pool (LeaveEngine) and join the threads

`load` runs on the client's receive thread; the engine decides how to interleave it with
generation (`rollout.on_weight_update`: finish or abort in-flight requests). An exception in
`load` is reported to the service (ReportLoaded ok=false) and the engine is retried by snapshot.

SGLang engine (the SGLang server joins the broadcast itself)::

    from kuberl.common.weights import EngineClient, sglang

    def apply(instruction) -> None:   # kuberl.api.weight_sync.v1.weight_sync_pb2.UpdateInstruction
        post("/pause_generation")
        post("/init_weights_update_group", sglang.init_group_request(instruction))
        for body in sglang.update_requests(instruction):
            post("/update_weights_from_distributed", body)
        post("/destroy_weights_update_group", sglang.destroy_group_request(instruction))
        post("/continue_generation")

    client = EngineClient(address, apply=apply, transports=("nccl",), device="cuda:0")

    # An SGLang server on the trainer's GPU (tp_size 1) can take CUDA IPC instead: offer
    # "cuda_ipc" and, for a TRANSPORT_CUDA_IPC instruction, post each of
    # sglang.tensor_update_requests(instruction) to /update_weights_from_tensor between
    # /begin_weight_update and /end_weight_update (generation paused around it).

    # A LoRA job's SGLang engine (`model.lora`: every version holds adapter tensors only) takes
    # them in this process instead, like the torch engine (`load=`, transports ("shm", "gloo",
    # "snapshot")), and hands each to SGLang as a PEFT folder: `kuberl.common.lora.save_adapter`,
    # then POST /load_lora_adapter (kuberl.rollout.engine.sglang.SGLangEngine.load_adapter).

Lower level: `Manifest` / `ManifestBuilder` (bucket layout, SGLang's flattened_bucket),
`make_receiver(transport)` (the data-plane factory), `download_snapshot(address)`,
`safetensors_header(manifest)` (header + payload = a .safetensors file).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kuberl.common.weights.chunks import CorruptSnapshot
    from kuberl.common.weights.engine import ApplyFn, EngineClient, LoadFn
    from kuberl.common.weights.manifest import (
        Manifest,
        ManifestBuilder,
        TensorEntry,
        dtype_name,
        plan,
        safetensors_header,
        torch_dtype,
    )
    from kuberl.common.weights.publisher import PublishResult, VersionConflict, WeightPublisher
    from kuberl.common.weights.transports import make_receiver
    from kuberl.common.weights.transports.snapshot import download_snapshot


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's `__getattr__` (PEP 562) importing each name from its module on first use:
    the weight-sync service reads manifests and chunks without the torch that the engine and
    publisher modules import."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


__getattr__ = lazy_exports(
    __name__,
    {
        "ApplyFn": "engine",
        "CorruptSnapshot": "chunks",
        "EngineClient": "engine",
        "LoadFn": "engine",
        "Manifest": "manifest",
        "ManifestBuilder": "manifest",
        "PublishResult": "publisher",
        "TensorEntry": "manifest",
        "VersionConflict": "publisher",
        "WeightPublisher": "publisher",
        "download_snapshot": "transports.snapshot",
        "dtype_name": "manifest",
        "make_receiver": "transports",
        "plan": "manifest",
        "safetensors_header": "manifest",
        "torch_dtype": "manifest",
    },
)

__all__ = [
    "ApplyFn",
    "CorruptSnapshot",
    "EngineClient",
    "LoadFn",
    "Manifest",
    "ManifestBuilder",
    "PublishResult",
    "TensorEntry",
    "VersionConflict",
    "WeightPublisher",
    "download_snapshot",
    "dtype_name",
    "make_receiver",
    "plan",
    "safetensors_header",
    "torch_dtype",
]
