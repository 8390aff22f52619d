"""The torch engine with `model.lora`: it injects the job's adapters at load, a version of adapter
tensors is applied in place (served logprobs are then PEFT's for that adapter), and a version
naming base weights is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from kuberl.common import lora
from kuberl.common.config import LoraConfig
from kuberl.rollout.engine.base import EngineRejected, SamplingParams
from kuberl.rollout.engine.torch_engine import TorchEngine
from tests.tiny_models import build_tokenizer, save_tiny_model

CFG = LoraConfig(rank=4, alpha=8)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("base"), seed=0)


@pytest.fixture(scope="module")
def adapter_dir(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained-looking adapter in PEFT's saved format (random non-zero B matrices)."""
    from transformers import AutoModelForCausalLM

    model = lora.inject(AutoModelForCausalLM.from_pretrained(base_dir), CFG)
    gen = torch.Generator().manual_seed(1)
    tensors = {
        n: (torch.randn(p.shape, generator=gen) * 0.3 if "lora_B" in n else p.detach())
        for n, p in lora.adapter_tensors(model.named_parameters())
    }
    return lora.save_adapter(tmp_path_factory.mktemp("adapter"), tensors.items(), CFG)


def _peft_logprobs(base_dir: Path, adapter_dir: Path, prompt: list[int], response: list[int]):
    """log_softmax of each response token under PEFT's own PeftModel of the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([prompt + response])).logits[0]  # [P+R, V]
    lp = torch.log_softmax(logits.float(), dim=-1)
    return [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(response)]


def _run(engine: TorchEngine, coro_fn):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        try:
            return await coro_fn()
        finally:
            await engine.close()

    return asyncio.run(go())


def test_an_adapter_version_applied_in_place_serves_peft_logprobs(
    base_dir: Path, adapter_dir: Path
) -> None:
    engine = TorchEngine.from_pretrained(base_dir, adapters=CFG)
    prompt = build_tokenizer()("What is 2+3?")["input_ids"]
    base = {n: t.clone() for n, t in engine.model.named_parameters() if "lora" not in n}

    async def go():  # type: ignore[no-untyped-def]
        await engine.load_weights(lora.load_adapter(adapter_dir), version=1)
        return await engine.generate([prompt], GREEDY)

    out = _run(engine, go)[0][0]
    expected = _peft_logprobs(base_dir, adapter_dir, prompt, out.token_ids)
    params = dict(engine.model.named_parameters())
    unchanged = all(torch.equal(t, params[n]) for n, t in base.items())
    assert out.version_start == 1 and unchanged
    assert out.logprobs == pytest.approx(expected, abs=1e-4)


def test_a_version_with_base_weights_is_refused_naming_them(base_dir: Path) -> None:
    engine = TorchEngine.from_pretrained(base_dir, adapters=CFG)
    state = engine.model.state_dict()
    adapter = "model.layers.0.self_attn.q_proj.lora_B.default.weight"
    base = "model.layers.0.self_attn.q_proj.base_layer.weight"
    before = state[adapter].clone()
    version = {adapter: state[adapter] + 1, base: state[base]}
    with pytest.raises(EngineRejected, match=r"adapter tensors only .* 1 others, e\.g\. \['model"):
        _run(engine, lambda: engine.load_weights(version, 1))
    assert torch.equal(engine.model.state_dict()[adapter], before) and engine.version == 0


def test_a_peft_adapter_folder_loads_from_disk(base_dir: Path, adapter_dir: Path) -> None:
    engine = TorchEngine.from_pretrained(base_dir, adapters=CFG)
    _run(engine, lambda: engine.update_weights_from_disk(str(adapter_dir), version=2))
    loaded = lora.load_adapter(adapter_dir)
    state = engine.model.state_dict()
    assert engine.version == 2
    assert all(torch.equal(state[n], t) for n, t in loaded.items())


def test_without_lora_the_engine_has_no_adapters(base_dir: Path) -> None:
    engine = TorchEngine.from_pretrained(base_dir)
    asyncio.run(engine.close())
    assert not any(lora.is_adapter_tensor(n) for n in engine.model.state_dict())
