"""An offloaded KL reference at ZeRO stage 0-2 (`algorithm.kl.offload_reference`) lives in CPU
memory and is on the GPU only for its reference pass, with the same logprobs as a resident one.
Needs a CUDA device; skipped cleanly without one. Passed on an H200 (2026-11-26). The ZeRO-3
form (DeepSpeed's offload_param) runs on CPU in tests/integration/test_trainer_zero.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_an_offloaded_reference_visits_the_gpu_only_for_its_pass(tmp_path: Path) -> None:
    from kuberl.common.config import TrainerConfig
    from kuberl.common.modelbuild import build_model
    from kuberl.trainer.batching import collate
    from kuberl.trainer.distributed import DistInfo
    from kuberl.trainer.engine import FrozenModel, PolicyModel, load_causal_lm
    from tests.integration.test_trainer_zero import _samples

    model_dir = build_model(tmp_path / "model", tokenizer="digits", seed=3)
    cuda = torch.device("cuda")
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=cuda)
    mb = collate(_samples(), 0, cuda)

    def reference(offload: bool) -> FrozenModel:
        model = PolicyModel(load_causal_lm(model_dir, torch.float32))
        return FrozenModel(model, TrainerConfig(zero_stage=0), info, torch.float32, offload=offload)

    resident = reference(False)
    with resident.resident():
        expected = resident.forward(mb.input_ids, mb.attention_mask)
    del resident
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    offloaded = reference(True)
    assert {p.device.type for p in offloaded.module.parameters()} == {"cpu"}
    assert torch.cuda.memory_allocated() == before  # building it put nothing on the GPU
    with offloaded.resident():
        assert {p.device.type for p in offloaded.module.parameters()} == {"cuda"}
        got = offloaded.forward(mb.input_ids, mb.attention_mask)
    assert {p.device.type for p in offloaded.module.parameters()} == {"cpu"}
    # Back in CPU memory: what stays on the GPU is this pass's output, not the weights.
    assert torch.cuda.memory_allocated() - before <= got.numel() * got.element_size() + (1 << 20)
    valid = mb.attention_mask[:, 1:].bool()
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-5, atol=1e-5)
