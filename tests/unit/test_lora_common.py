"""kuberl.common.lora against PEFT itself: injected adapters, the base-model switch, the saved
format PEFT (and SGLang) read back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kuberl.common import lora
from kuberl.common.config import LoraConfig
from kuberl.common.modelbuild import build_model


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("base"), arch="qwen2", size="tiny")


def load(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def perturbed(model: torch.nn.Module) -> None:
    """Non-zero B matrices: freshly injected adapters are the identity (B = 0)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


IDS = torch.tensor([[1, 5, 7, 3, 9, 2]])


def test_inject_trains_only_adapters_and_names_match_peft(base_dir: Path) -> None:
    cfg = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    model = lora.inject(load(base_dir), cfg)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    # tiny qwen2: 4 layers x 2 targets x (A, B)
    assert len(trainable) == 16
    assert all(lora.is_adapter_tensor(n) for n in trainable)
    assert "model.layers.0.self_attn.q_proj.lora_A.default.weight" in trainable
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # r=4 on two 128x128 / 128x64 projections per layer: well under 5% of the model's bytes
    assert adapters / (adapters + frozen) < 0.05


def test_adapters_disabled_is_the_base_model_and_restores_grads(base_dir: Path) -> None:
    base = load(base_dir)
    model = lora.inject(load(base_dir), LoraConfig(rank=4, alpha=8))
    perturbed(model)
    with torch.no_grad():
        want = base(IDS).logits
        adapted = model(IDS).logits
        with lora.adapters_disabled(model):
            off = model(IDS).logits
        again = model(IDS).logits
    assert not torch.allclose(adapted, want, atol=1e-4)  # the adapters change the output
    torch.testing.assert_close(off, want)
    torch.testing.assert_close(again, adapted)
    assert all(p.requires_grad for n, p in model.named_parameters() if lora.is_adapter_tensor(n))


def test_saved_adapter_loads_in_peft_with_same_outputs(base_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    cfg = LoraConfig(rank=4, alpha=16, target_modules=["q_proj", "k_proj", "down_proj"])
    model = lora.inject(load(base_dir), cfg)
    perturbed(model)
    out = lora.save_adapter(
        tmp_path / "adapter", lora.adapter_tensors(model.named_parameters()), cfg, str(base_dir)
    )
    reference = PeftModel.from_pretrained(load(base_dir), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(reference(IDS).logits, model(IDS).logits)
    # and back under the injected names, every tensor equal
    loaded = lora.load_adapter(out)
    params = dict(model.named_parameters())
    assert set(loaded) == {n for n in params if lora.is_adapter_tensor(n)}
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, params[name].detach())


def test_peft_names_round_trip() -> None:
    name = "model.layers.3.mlp.down_proj.lora_B.default.weight"
    assert lora.to_peft_name(name) == "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"
    assert lora.from_peft_name(lora.to_peft_name(name)) == name
    with pytest.raises(ValueError, match="not a PEFT adapter tensor name"):
        lora.from_peft_name("model.layers.3.mlp.down_proj.weight")


def test_unknown_target_modules_name_the_field(base_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules .*q_proj"):
        lora.inject(load(base_dir), LoraConfig(target_modules=["query_key_value"]))
