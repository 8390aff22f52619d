"""LoRA adapters (`model.lora`) as every service sees them: injected in place, named alike.

The trainer and the torch engine inject the same adapters into the same base model with
`inject`, so an adapter tensor has one name on both sides (`model.layers.0.self_attn.q_proj.
lora_A.default.weight`) and weight-sync moves adapter tensors under those names only. PEFT's
saved format (what SGLang's `/load_lora_adapter` and `PeftModel.from_pretrained` read) names them
without the adapter name and under `base_model.model.`: `to_peft_name` maps one to the other.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kuberl.common.config import LoraConfig

#: PEFT's name for the one adapter a kuberl model carries.
ADAPTER = "default"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def peft_config(cfg: LoraConfig, base_model: str | None = None) -> Any:
    """`cfg` as PEFT's `LoraConfig` (a causal LM's adapters, no bias terms)."""
    import peft

    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def is_adapter_tensor(name: str) -> bool:
    """An adapter's own tensor (`lora_A`, `lora_B`, ...), not a base weight it wraps."""
    return any(part.startswith("lora_") for part in name.split("."))


def inject(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Wrap `model`'s target layers with adapters, in place, and train only the adapters.

    Raises ValueError naming `model.lora.target_modules` when none of them is in the model."""
    import peft

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = sorted(set(cfg.target_modules) - present)
    if len(missing) == len(set(cfg.target_modules)):
        raise ValueError(
            f"model.lora.target_modules {list(cfg.target_modules)}: the model has no layer of "
            f"these names; its linear layers include {sorted(_linear_names(model))[:12]}"
        )
    peft.inject_adapter_in_model(peft_config(cfg), model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_tensor(name))
    return model


def _linear_names(model: nn.Module) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def adapter_layers(model: nn.Module) -> list[Any]:
    """The modules `inject` wrapped (PEFT's tuner layers)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base model (the KL reference of a LoRA job: no second copy).

    PEFT's toggle also clears the adapters' requires_grad; it is restored on the way out, as the
    optimizer's parameter groups expect."""
    layers = adapter_layers(model)
    trainable = [(p, p.requires_grad) for n, p in model.named_parameters() if is_adapter_tensor(n)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for param, flag in trainable:
            param.requires_grad_(flag)


def adapter_tensors(
    named: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter tensors among `named` (a model's named parameters or state)."""
    return ((name, t) for name, t in named if is_adapter_tensor(name))


def merged(
    named: Iterable[tuple[str, torch.Tensor]], cfg: LoraConfig
) -> list[tuple[str, torch.Tensor]]:
    """An injected model's full tensors with the adapters merged in, under the base model's
    names: what PEFT's `merge_and_unload` leaves, W + (alpha / r) * B @ A per wrapped layer,
    computed in float32 and stored in W's dtype. `named` holds every tensor (a gathered state)."""
    state = dict(named)
    scale = cfg.alpha / cfg.rank
    out = []
    for name, tensor in state.items():
        if is_adapter_tensor(name):
            continue
        layer, wrapped, leaf = name.rpartition(".base_layer.")
        if not wrapped:  # not a wrapped layer's own tensor
            out.append((name, tensor))
            continue
        if leaf == "weight":
            a = state[f"{layer}.lora_A.{ADAPTER}.weight"].float()  # [r, in]
            b = state[f"{layer}.lora_B.{ADAPTER}.weight"].float()  # [out, r]
            tensor = (tensor.float() + scale * (b @ a)).to(tensor.dtype)  # [out, in]
        out.append((f"{layer}.{leaf}", tensor))
    return out


def to_peft_name(name: str) -> str:
    """An injected model's adapter tensor name as PEFT saves it (`save_adapter`)."""
    return _PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def from_peft_name(name: str) -> str:
    """The inverse of `to_peft_name`."""
    if not name.startswith(_PEFT_PREFIX):
        raise ValueError(f"{name!r} is not a PEFT adapter tensor name ({_PEFT_PREFIX}...)")
    stem, _, leaf = name[len(_PEFT_PREFIX) :].rpartition(".")
    return f"{stem}.{ADAPTER}.{leaf}"


def save_adapter(
    directory: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    cfg: LoraConfig,
    base_model: str | None = None,
) -> Path:
    """Write the adapter as PEFT saves one (`adapter_config.json` + `adapter_model.safetensors`):
    what `PeftModel.from_pretrained`, SGLang's `/load_lora_adapter` and the hub read."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = {to_peft_name(n): t.detach().to("cpu").contiguous() for n, t in tensors}
    if not state:
        raise ValueError("no adapter tensors to save (is model.lora set for this model?)")
    save_file(state, str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    config = peft_config(cfg, base_model).to_dict()
    (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(_jsonable(config), indent=2))
    return directory


def _jsonable(value: Any) -> Any:
    """PEFT's config dict holds sets and enums; adapter_config.json holds their plain values."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in value]
        return sorted(items) if isinstance(value, (set, frozenset)) else items
    if hasattr(value, "value") and not isinstance(value, (str, int, float, bool)):
        return value.value
    return value


def load_adapter(directory: Path) -> dict[str, torch.Tensor]:
    """A saved adapter's tensors under the injected model's names."""
    from safetensors.torch import load_file

    return {
        from_peft_name(n): t for n, t in load_file(str(directory / ADAPTER_WEIGHTS_FILE)).items()
    }
