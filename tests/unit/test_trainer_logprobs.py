"""Vocabulary-chunked logprobs and entropies equal the full-logits computation, values and
gradients, and the model head built on them gives the HF model's own numbers."""

from __future__ import annotations

import pytest
import torch

from kuberl.trainer.logprobs import (
    LogprobHead,
    chunked_logprobs_and_entropy,
    full_logprobs_and_entropy,
)


def _inputs(n: int = 37, h: int = 16, v: int = 1000, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, dtype=dtype, generator=g, requires_grad=True)
    weight = torch.randn(v, h, dtype=dtype, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize(("chunk", "temperature"), [(128, 1.0), (7, 0.7), (1000, 1.3), (4096, 1.0)])
def test_chunked_logprobs_and_entropy_equal_full_logits(chunk: int, temperature: float) -> None:
    hidden, weight, targets = _inputs()
    lp, ent = chunked_logprobs_and_entropy(hidden, weight, targets, chunk, temperature)
    ref_lp, ref_ent = full_logprobs_and_entropy(hidden @ weight.T, targets, temperature)
    assert torch.allclose(lp, ref_lp, rtol=0, atol=1e-12)
    assert torch.allclose(ent, ref_ent, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk", [64, 333])
def test_chunked_gradients_equal_full_logits_gradients(chunk: int) -> None:
    hidden, weight, targets = _inputs()
    g = torch.Generator().manual_seed(1)
    w_lp = torch.randn(targets.shape, dtype=torch.float64, generator=g)
    w_ent = torch.randn(targets.shape, dtype=torch.float64, generator=g)
    lp, ent = chunked_logprobs_and_entropy(hidden, weight, targets, chunk, 0.9)
    ours = torch.autograd.grad((lp * w_lp + ent * w_ent).sum(), [hidden, weight])
    ref_lp, ref_ent = full_logprobs_and_entropy(hidden @ weight.T, targets, 0.9)
    ref = torch.autograd.grad((ref_lp * w_lp + ref_ent * w_ent).sum(), [hidden, weight])
    for a, b in zip(ours, ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_float32_inputs_agree_with_full_logits_to_float32_precision() -> None:
    hidden, weight, targets = _inputs(n=64, v=5000, dtype=torch.float32)
    lp, ent = chunked_logprobs_and_entropy(hidden, weight, targets, 512)
    ref_lp, ref_ent = full_logprobs_and_entropy(hidden @ weight.T, targets)
    assert (lp - ref_lp).abs().max() < 1e-4 and (ent - ref_ent).abs().max() < 1e-4


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=pytest.mark.slow, id="compiled")]
)
def test_bf16_values_and_gradients_stay_near_the_float64_reference(compiled: bool) -> None:
    # bf16 GEMMs (forward and both backward products) with fp32 softmax statistics: the
    # relative error of every output is of the order of bf16's 2^-8, not worse. Compiled too:
    # a GPU run uses the fused chunk functions (`trainer.compile_logprobs`) on bf16 inputs.
    hidden, weight, targets = _inputs(n=64, h=32, v=3000)
    g = torch.Generator().manual_seed(2)
    w_lp = torch.randn(targets.shape, dtype=torch.float64, generator=g)
    w_ent = torch.randn(targets.shape, dtype=torch.float64, generator=g)
    ref_lp, ref_ent = full_logprobs_and_entropy(hidden @ weight.T, targets, 0.8)
    ref = torch.autograd.grad((ref_lp * w_lp + ref_ent * w_ent).sum(), [hidden, weight])
    h16 = hidden.detach().to(torch.bfloat16).requires_grad_(True)
    w16 = weight.detach().to(torch.bfloat16).requires_grad_(True)
    lp, ent = chunked_logprobs_and_entropy(h16, w16, targets, 700, 0.8, compiled)
    ours = torch.autograd.grad((lp * w_lp + ent * w_ent).sum(), [h16, w16])

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b).norm() / b.norm())

    assert (lp.dtype, ours[0].dtype, ours[1].dtype) == (
        torch.float32,
        torch.bfloat16,
        torch.bfloat16,
    )
    assert max(rel(lp, ref_lp), rel(ent, ref_ent)) < 2e-2
    assert max(rel(a, b) for a, b in zip(ours, ref, strict=True)) < 2e-2


@pytest.mark.slow
def test_the_compiled_chunk_functions_give_the_eager_numbers_and_gradients() -> None:
    # torch.compile fuses each chunk's elementwise work (inductor's C++ backend here, Triton on
    # a GPU); values and gradients must be the eager ones up to float32 summation order, for
    # two micro-batch lengths (dynamic shapes) and a vocabulary the chunk does not divide.
    for n in (64, 37):
        hidden, weight, targets = _inputs(n=n, h=32, v=3000, dtype=torch.float32)
        g = torch.Generator().manual_seed(n)
        w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
        results = []
        for compiled in (False, True):
            lp, ent = chunked_logprobs_and_entropy(hidden, weight, targets, 700, 0.9, compiled)
            grads = torch.autograd.grad((lp * w_lp + ent * w_ent).sum(), [hidden, weight])
            results.append((lp, ent, *grads))
        for eager, fused in zip(*results, strict=True):
            assert torch.allclose(eager, fused, rtol=1e-4, atol=1e-5)


def test_a_batch_shape_is_kept() -> None:
    hidden, weight, targets = _inputs(n=12)
    lp, ent = chunked_logprobs_and_entropy(hidden.reshape(3, 4, -1), weight, targets.reshape(3, 4))
    assert lp.shape == ent.shape == (3, 4)


def test_bad_arguments_are_rejected_with_the_reason() -> None:
    hidden, weight, targets = _inputs(n=4)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs_and_entropy(hidden, weight, targets, 0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs_and_entropy(hidden, weight, targets, 8, 0.0)
    with pytest.raises(ValueError, match="positions"):
        chunked_logprobs_and_entropy(hidden, weight, targets[:3], 8)


def test_policy_model_logprobs_equal_the_hf_models_own_logits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kuberl.common.modelbuild import build_model
    from kuberl.trainer.engine import PolicyModel, load_causal_lm, split_outputs

    path = build_model(tmp_path / "m", tokenizer="digits", seed=1)
    ids = torch.randint(5, 90, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ref_lp, ref_ent = full_logprobs_and_entropy(
        load_causal_lm(path, torch.float32)(input_ids=ids, attention_mask=mask).logits[:, :-1],
        ids[:, 1:],
    )
    policy = PolicyModel(load_causal_lm(path, torch.float32), chunk_size=16)
    lp, ent = split_outputs(policy(ids, mask))
    assert isinstance(policy.hf.get_output_embeddings(), LogprobHead)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)


def test_outputs_at_the_response_positions_equal_every_positions_outputs_gathered(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The trainer asks the policy and the critic for the response positions only (the head
    # skips the prompt); values and every gradient must be those of all positions gathered.
    import numpy as np

    from kuberl.common.modelbuild import build_model
    from kuberl.trainer.batching import TrainingSequence, collate
    from kuberl.trainer.engine import PolicyModel, ValueModel, load_causal_lm

    path = build_model(tmp_path / "m", tokenizer="digits", seed=1)
    rng = np.random.default_rng(4)
    samples = [
        TrainingSequence(
            rng.integers(5, 90, p), rng.integers(5, 90, r), np.ones(r, np.float32), index=i
        )
        for i, (p, r) in enumerate([(7, 5), (3, 9), (12, 1)])  # right-padded to 15 tokens
    ]
    mb = collate(samples, 0, torch.device("cpu"))
    policy = PolicyModel(load_causal_lm(path, torch.float32), chunk_size=16)
    backbone = load_causal_lm(path, torch.float32)
    critic = ValueModel(backbone.get_decoder(), backbone.config.hidden_size)
    torch.nn.init.normal_(critic.value_head.weight, generator=torch.Generator().manual_seed(5))
    for model in (policy, critic):
        results = []
        for positions in (None, mb.gather_index):
            model.zero_grad()
            out = model(mb.input_ids, mb.attention_mask, positions)
            if positions is None:  # [b, T-1, ...] -> [b, R, ...]
                index = mb.gather_index.reshape(*mb.gather_index.shape, *[1] * (out.dim() - 2))
                out = out.gather(1, index.expand(-1, -1, *out.shape[2:]))
            weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
            (
                out * weights * mb.mask.reshape(*mb.mask.shape, *[1] * (out.dim() - 2))
            ).sum().backward()
            results.append([out.detach()] + [p.grad.clone() for p in model.parameters()])
        assert results[1][0].shape[:2] == mb.mask.shape == (3, 9)
        for every, picked in zip(*results, strict=True):
            assert torch.allclose(every, picked, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compiled_decoder_layers_give_the_eager_logprobs_and_gradients(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # trainer.compile_model: every decoder layer compiled in place (one graph for all), on
    # right-padded batches of two lengths; outputs and every gradient match the eager model,
    # and so do no-grad outputs (the reference policy is compiled too).
    from kuberl.common.modelbuild import build_model
    from kuberl.trainer.engine import PolicyModel, compile_decoder_layers, load_causal_lm

    path = build_model(tmp_path / "m", tokenizer="digits", seed=1)
    eager = PolicyModel(load_causal_lm(path, torch.float32), chunk_size=16)
    fused = PolicyModel(load_causal_lm(path, torch.float32), chunk_size=16)
    assert compile_decoder_layers(fused.hf) == len(fused.hf.get_decoder().layers) > 0
    g = torch.Generator().manual_seed(3)
    for rows, length in ((3, 11), (2, 17)):
        ids = torch.randint(5, 90, (rows, length), generator=g)
        mask = torch.ones_like(ids)
        mask[0, length - 4 :] = 0  # one right-padded row
        results = []
        for model in (eager, fused):
            model.zero_grad()
            out = model(ids, mask)
            (out[..., 0].sum() + 0.1 * out[..., 1].sum()).backward()
            results.append([out.detach()] + [p.grad.clone() for p in model.parameters()])
        for a, b in zip(*results, strict=True):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
        with torch.no_grad():  # a frozen KL reference built the same way (its own graph)
            assert torch.allclose(eager(ids, mask), fused(ids, mask), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_150k_vocabulary_in_bf16_never_materialises_full_logits_on_gpu() -> None:
    dev = torch.device("cuda")
    n, h, v = 8192, 896, 151_936  # Qwen2-0.5B's head
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = (torch.randn(n, h, device=dev, generator=g) * 0.5).to(torch.bfloat16)
    weight = (torch.randn(v, h, device=dev, generator=g) * 0.05).to(torch.bfloat16)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    targets = torch.randint(0, v, (n,), device=dev, generator=g)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = chunked_logprobs_and_entropy(hidden, weight, targets, chunk_size=4096)
    (lp.sum() + 0.1 * ent.sum()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    full_logits_bytes = n * v * 4
    assert peak < 0.4 * full_logits_bytes, f"peak {peak / 2**30:.2f} GiB"
    with torch.no_grad():
        ref_lp, ref_ent = full_logprobs_and_entropy(hidden.float() @ weight.float().T, targets)
    assert (lp - ref_lp).abs().max() < 1e-2 and (ent - ref_ent).abs().max() < 1e-2


def test_models_whose_logits_are_not_a_plain_head_product_are_refused() -> None:
    # The chunked head computes hidden @ W^T alone: Phi's head bias and Cohere's logit scale
    # were silently dropped, 2.3 and 0.1 nats off the HF model's own logprobs.
    from transformers import CohereConfig, CohereForCausalLM, PhiConfig, PhiForCausalLM

    from kuberl.trainer.engine import PolicyModel

    small = {"vocab_size": 37, "hidden_size": 16, "intermediate_size": 32}
    small |= {"num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 32}
    phi = PhiForCausalLM(PhiConfig(**small))
    cohere = CohereForCausalLM(CohereConfig(**small, num_key_value_heads=2, eos_token_id=0))
    with pytest.raises(ValueError, match="output layer has a bias"):
        PolicyModel(phi)
    with pytest.raises(ValueError, match=r"transforms the logits \(logit_scale=0.0625\)"):
        PolicyModel(cohere)


def test_the_trainers_models_run_without_dropout_in_training_mode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The trainer's forwards run in training mode: GPT-2's dropout (0.1) made the PPO ratio,
    # the importance weights and recomputed old logprobs noisy, and step 1 unlike the others.
    from transformers import GPT2Config, GPT2LMHeadModel

    from kuberl.trainer.engine import load_causal_lm

    config = GPT2Config(vocab_size=37, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    model = load_causal_lm(tmp_path, torch.float32).train()
    ids = torch.randint(0, 37, (2, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(ids).logits, model(ids).logits)
    assert config.resid_pdrop == 0.1  # the saved model does have dropout
