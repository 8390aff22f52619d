"""The trainer's models under DeepSpeed: ZeRO config, forward passes, steps, gathered weights.
`TrainEngine` is a trainable module (the policy, whose `lm_head` computes logprobs in vocabulary
chunks, or the PPO critic `ValueModel`), `FrozenModel` the KL reference; every rank runs the
same number of forward and backward passes, since ZeRO-3 gathers parameters and ZeRO-2 reduces
gradients collectively in each of them (a rank out of micro-batches runs padding ones).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kuberl.common.config import ModelConfig, OptimizerConfig, TrainerConfig
from kuberl.common.logs import get_logger
from kuberl.trainer.batching import MicroBatch, padding_micro_batch
from kuberl.trainer.distributed import DistInfo, all_reduce_max
from kuberl.trainer.logprobs import LogprobHead

log = get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def train_dtype(model: ModelConfig, device: torch.device) -> torch.dtype:
    """bf16 (or the job's dtype) on GPU; always fp32 on CPU, where bf16 matmuls are slow."""
    if device.type != "cuda":
        return torch.float32
    return DTYPES[model.dtype]


def deepspeed_config(
    trainer: TrainerConfig, dtype: torch.dtype, *, train: bool = True
) -> dict[str, Any]:
    """The DeepSpeed config dict for the job's trainer section."""
    stage = trainer.zero_stage
    zero: dict[str, Any] = {
        "stage": stage,
        # Unmanaged gradient accumulation supports overlap_comm only on stage 2; it buys
        # nothing on gloo anyway.
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": 50_000_000,
        "allgather_bucket_size": 50_000_000,
    }
    if stage == 3:
        zero.update(
            stage3_param_persistence_threshold=0,
            stage3_prefetch_bucket_size=50_000_000,
            stage3_max_live_parameters=100_000_000,
            stage3_gather_16bit_weights_on_model_save=False,
        )
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if train:
        cfg["gradient_clipping"] = trainer.optimizer.grad_clip
        cfg["managed_gradient_accumulation"] = False
    return cfg


def full_numel(p: nn.Parameter) -> int:
    """A parameter's number of elements, a ZeRO-3 partitioned one's at its full size."""
    return int(getattr(p, "ds_numel", p.numel()))


def load_causal_lm(path: str | Path, dtype: torch.dtype) -> Any:
    """An HF causal LM from a local folder (never the hub), with eager-free SDPA attention and
    dropout off (`disable_dropout`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, local_files_only=True, attn_implementation="sdpa"
    )
    disable_dropout(model)
    return model


#: Float attributes HF attention and MLP modules keep their dropout probability in (read only in
#: training mode), beside nn.Dropout modules.
_DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout", "resid_dropout")


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability of `model` to 0 (its saved config keeps its own).

    The trainer runs its forwards in training mode: with dropout, the PPO ratio, the
    importance weights and the KL to the reference would carry dropout noise, and recomputed
    old logprobs would not be the rollout's (RL trainers, TRL among them, turn it off). Qwen2 and
    Llama have none; GPT-2, OPT and Phi-2 do."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name in _DROPOUT_ATTRIBUTES:
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


class PolicyModel(nn.Module):
    """A causal LM whose forward returns per-token logprobs and entropies of the given ids.

    forward(input_ids [B, T], attention_mask [B, T], positions [B, R] or None) -> [B, R, 2]:
    the logprob and the entropy (`split_outputs`) at each of `positions`, where position t
    scores token t+1 given tokens 0..t; all T-1 positions when `positions` is None (right
    padding; padded positions hold garbage the caller masks out). The trainer passes the
    response positions (`MicroBatch.gather_index`): the head, a [tokens, vocabulary] product
    forward and two backward, never runs on the prompt, whose logprobs no loss uses. One output
    tensor, not two: see `LogprobHead`.
    """

    def __init__(
        self,
        hf_model: Any,
        chunk_size: int = 4096,
        temperature: float = 1.0,
        compiled: bool = False,
    ) -> None:
        super().__init__()
        self.hf = hf_model
        old = hf_model.get_output_embeddings()
        if not isinstance(old, LogprobHead):
            check_plain_head(hf_model, old)
            head = LogprobHead(old.weight, chunk_size, temperature, compiled)
            hf_model.set_output_embeddings(head)

    @property
    def backbone(self) -> nn.Module:
        return self.hf.get_decoder()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden, targets = hidden_at(self.backbone, input_ids, attention_mask, positions)
        return self.hf.get_output_embeddings()(hidden, targets)  # [B, R, 2]


#: Config fields of HF models whose forward transforms the head's logits (a scale, a softcap):
#: the chunked head computes hidden @ W^T alone.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_plain_head(hf_model: Any, head: Any) -> None:
    """Refuse a model whose logits are not `hidden @ head.weight^T`: the chunked head replaces
    the HF head by that product alone, so a head bias (Phi, GPT-J) or a logit scale or softcap
    in the model's forward (Granite, Cohere, Gemma 2) would silently give wrong logprobs,
    entropies and gradients, and a train/inference mismatch TIS/MIS would then 'correct'."""
    name = type(hf_model).__name__
    if getattr(head, "bias", None) is not None:
        raise ValueError(
            f"{name}: its output layer has a bias, which kuberl's chunked logprob head does not "
            "apply; such models are not supported by the trainer yet"
        )
    config = getattr(hf_model, "config", None)
    for field in _LOGIT_TRANSFORMS:
        value = getattr(config, field, None)
        if value not in (None, 1, 1.0, 0, 0.0, False):
            raise ValueError(
                f"{name}: its forward transforms the logits ({field}={value}), which kuberl's "
                "chunked logprob head does not; such models are not supported by the trainer yet"
            )


def hidden_at(
    backbone: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backbone's last hidden states [B, R, H] at `positions` [B, R] (each in [0, T-2]) and
    the tokens they predict [B, R]; every position's (R = T-1) when `positions` is None."""
    out = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    last = out.last_hidden_state  # [B, T, H]
    if positions is None:
        return last[:, :-1], input_ids[:, 1:]
    index = positions[..., None].expand(-1, -1, last.shape[-1])  # [B, R, H]
    return last.gather(1, index), input_ids.gather(1, positions + 1)


def enable_activation_checkpointing(hf_model: Any, mode: bool | str) -> None:
    """`trainer.gradient_checkpointing` on an HF causal LM: nothing (false), each decoder layer
    recomputed whole in the backward (true), or selectively ("selective").

    Selective is torch's selective activation checkpointing inside each layer's checkpoint:
    the outputs of the matrix products and of attention (`SAVED_OPS`) are kept from the
    forward, and only the cheap elementwise work between them is recomputed. Non-reentrant
    checkpointing either way (it works under DeepSpeed's hooks and torch.compile)."""
    if not mode:
        return
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = selective_checkpoint_contexts
    elif mode is not True:
        raise ValueError(f"gradient_checkpointing must be true, false or 'selective', got {mode!r}")
    if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers >= 5
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


#: The aten ops whose outputs selective checkpointing keeps: the matrix products (a linear
#: layer is `mm`/`addmm` by the time it reaches dispatch) and attention, per backend.
SAVED_OPS = (
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def selective_checkpoint_contexts() -> Any:
    """The forward and recompute contexts of one checkpointed region (`context_fn`)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    aten = torch.ops.aten
    ops = [getattr(aten, name).default for name in SAVED_OPS if hasattr(aten, name)]
    return create_selective_checkpoint_contexts(ops)


def compile_decoder_layers(hf_model: Any) -> int:
    """`torch.compile` each decoder layer of an HF causal LM in place and return how many.

    Regional compilation: the layers share one structure, so dynamo traces one graph and reuses
    it for all of them (a compile of seconds, not of the whole model); shapes are dynamic, as
    micro-batches differ in length. The embeddings and the head stay eager (the head has its own
    option, `compile_logprobs`). ZeRO-3 is refused: its parameter-gathering hooks run inside the
    layers' forward and backward."""
    layers = getattr(hf_model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError("trainer.compile_model: the model has no decoder layers to compile")
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def build_policy(hf_model: Any, tc: TrainerConfig, temperature: float = 1.0) -> PolicyModel:
    """The trainer's policy around an HF causal LM: its decoder layers compiled with
    `tc.compile_model`, the logprob head with `tc`'s chunk size and `compile_logprobs`."""
    if tc.compile_model:
        log.info("trainer.compile_model", layers=compile_decoder_layers(hf_model))
    return PolicyModel(hf_model, tc.logprob_chunk_size, temperature, tc.compile_logprobs)


def split_outputs(outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`PolicyModel` outputs [B, R, 2] -> (logprobs [B, R], entropy [B, R])."""
    return outputs[..., 0], outputs[..., 1]


class ValueModel(nn.Module):
    """PPO critic: the policy's architecture with a scalar value head on every position.

    forward(input_ids [B, T], attention_mask [B, T], positions [B, R] or None) -> values
    [B, R], aligned with `PolicyModel`'s outputs (position t is the value of the state before
    token t+1).
    """

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden, _ = hidden_at(self.backbone, input_ids, attention_mask, positions)  # [B, R, H]
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)  # [B, R]


def make_optimizer(module: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """torch AdamW; no weight decay on biases and norms (1-D parameters)."""
    decay = [p for p in module.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False
    )


def make_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig
) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over `warmup_steps` optimizer steps, then constant."""
    warmup = cfg.warmup_steps

    def factor(step: int) -> float:
        return 1.0 if warmup == 0 else min(1.0, (step + 1) / warmup)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _weights_only_loads(engine: Any) -> None:
    """Make DeepSpeed read its checkpoint files with `torch.load(weights_only=True)`.

    DeepSpeed writes its shards with torch.save (pickle) and reads them with weights_only=False,
    so a tampered checkpoint would run code when a trainer resumes. Its files hold tensors,
    plain containers and these few DeepSpeed classes (0.19: optimizer shards of ZeRO 1-3 and the
    fp16/bf16 optimizers), which torch's restricted unpickler may rebuild; anything else fails
    the load with the name of the refused class (docs/security.md)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    allowed = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]

    def load(path: str, map_location: Any = None) -> Any:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)

    engine.checkpoint_engine.load = load


class TrainEngine:
    """One trainable module (policy or critic) under a DeepSpeed engine: the job's ZeRO stage
    (0-3), bf16 on GPU and fp32 on CPU, a plain torch AdamW (DeepSpeed's compiled Adam would
    need an op build at first start) and gradient clipping. The caller owns gradient
    accumulation (`managed_gradient_accumulation` off): it runs any number of micro-batches,
    chosen by a token budget, then calls `step()`. A module with frozen parameters (LoRA's base
    model) is optimized over its trainable ones only, and its checkpoints hold only those (the
    frozen ones are the model folder's, loaded again on resume)."""

    def __init__(
        self, module: nn.Module, trainer: TrainerConfig, dist_info: DistInfo, dtype: torch.dtype
    ) -> None:
        import deepspeed

        self.dist = dist_info
        self.dtype = dtype
        self.zero_stage = trainer.zero_stage
        #: Some parameters are frozen (LoRA): checkpoints leave them out.
        self.has_frozen = any(not p.requires_grad for p in module.parameters())
        module = module.to(device=dist_info.device, dtype=dtype)
        optimizer = make_optimizer(module, trainer.optimizer)
        scheduler = make_scheduler(optimizer, trainer.optimizer)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=deepspeed_config(trainer, dtype),
        )
        self._stage0_norm = float("nan")
        if self.zero_stage == 0:
            self._record_stage0_grad_norm()

    def _record_stage0_grad_norm(self) -> None:
        # Without ZeRO, DeepSpeed clips fp32 gradients and drops the norm; keep it.
        from deepspeed.runtime.utils import clip_grad_norm_

        eng = self.engine

        def clip() -> None:
            norm = clip_grad_norm_(
                parameters=eng.module.parameters(), max_norm=eng.gradient_clipping(), mpu=eng.mpu
            )
            self._stage0_norm = float(norm)

        eng.clip_fp32_gradients = clip

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    def forward(self, *args: Any) -> Any:
        return self.engine(*args)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        """Reduce the accumulated gradients, clip, update; return the pre-clip grad norm."""
        self._stage0_norm = float("nan")
        self.engine.step()
        if self.zero_stage == 0 and not math.isnan(self._stage0_norm):
            return self._stage0_norm
        # ZeRO, or stage 0 in bf16/fp16: DeepSpeed's own optimizer wrapper clips (and keeps the
        # norm) instead of clip_fp32_gradients, which is never called then.
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def save(self, directory: Path, tag: str) -> None:
        self.engine.save_checkpoint(
            str(directory), tag=tag, exclude_frozen_parameters=self.has_frozen
        )

    def load(self, directory: Path, tag: str) -> None:
        _weights_only_loads(self.engine)
        path, _ = self.engine.load_checkpoint(
            str(directory),
            tag=tag,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            # Frozen parameters are not in the checkpoint (`save`): they stay as loaded.
            load_module_strict=not self.has_frozen,
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} in {directory}")

    def full_parameters(
        self,
        bucket_bytes: int,
        prefix_strip: str = "",
        select: Callable[[str], bool] | None = None,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The full parameters in buckets of about `bucket_bytes`, as CPU tensors on rank 0;
        only those whose (stripped) name `select` accepts, when given.

        Collective: every rank must iterate. Under ZeRO-3 each bucket is all-gathered, copied
        and released before the next, so no rank ever holds the whole model at once; other
        ranks get empty lists. Tied weights appear once, under their first name.
        """
        yield from iter_full_parameters(self.module, bucket_bytes, self.dist, prefix_strip, select)


def iter_full_parameters(
    module: nn.Module,
    bucket_bytes: int,
    dist_info: DistInfo,
    prefix_strip: str = "",
    select: Callable[[str], bool] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """See `TrainEngine.full_parameters`."""
    import deepspeed

    seen: set[int] = set()
    named: list[tuple[str, nn.Parameter]] = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        name = name.removeprefix(prefix_strip)
        if select is None or select(name):
            named.append((name, p))

    bucket: list[tuple[str, nn.Parameter]] = []
    size = 0
    for name, p in named:
        nbytes = full_numel(p) * p.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield _gather_bucket(bucket, dist_info, deepspeed)
            bucket, size = [], 0
        bucket.append((name, p))
        size += nbytes
    if bucket:
        yield _gather_bucket(bucket, dist_info, deepspeed)


def _gather_bucket(
    bucket: list[tuple[str, nn.Parameter]], dist_info: DistInfo, deepspeed: Any
) -> list[tuple[str, torch.Tensor]]:
    params = [p for _, p in bucket]
    partitioned = any(hasattr(p, "ds_id") for p in params)
    ctx = (
        deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        if partitioned
        else contextlib.nullcontext()
    )
    with ctx:
        if not dist_info.is_main:
            return []
        return [(name, p.detach().to("cpu", copy=True)) for name, p in bucket]


class FrozenModel:
    """A frozen policy (the KL reference): forward only, never stepped.

    With ZeRO-3 it is partitioned like the policy (DeepSpeed inference engine with ZeRO-3, as
    OpenRLHF does); otherwise it is a plain module on the trainer's device, which is cheapest
    for small models. With `offload` its weights live in CPU memory between uses: under ZeRO-3
    by DeepSpeed's `offload_param` (layers fetched to the device for their forward), otherwise
    the whole module is moved to the device for a reference pass (`resident`) and back after.
    """

    def __init__(
        self,
        module: PolicyModel,
        trainer: TrainerConfig,
        dist_info: DistInfo,
        dtype: torch.dtype,
        *,
        offload: bool = False,
    ) -> None:
        module.requires_grad_(False)
        module.eval()
        self.engine: Any = None
        self.device = dist_info.device
        # Only the stage 0-2 form moves the module itself; under ZeRO-3 DeepSpeed does it.
        self.offloaded = offload and trainer.zero_stage != 3
        if trainer.zero_stage == 3:
            import deepspeed

            config = deepspeed_config(trainer, dtype, train=False)
            if offload:
                config["zero_optimization"]["offload_param"] = {
                    "device": "cpu",
                    "pin_memory": dist_info.device.type == "cuda",
                }
            module = module.to(device=dist_info.device, dtype=dtype)
            self.engine, *_ = deepspeed.initialize(model=module, config=config)
            self.module: nn.Module = self.engine.module
        else:
            home = torch.device("cpu") if self.offloaded else dist_info.device
            self.module = module.to(device=home, dtype=dtype)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Around a reference pass: an offloaded stage 0-2 reference is on the device inside
        and back in CPU memory after (its device memory freed); otherwise nothing moves."""
        if not self.offloaded or self.device.type == "cpu":
            yield
            return
        self.module.to(self.device)
        try:
            yield
        finally:
            self.module.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    @torch.no_grad()
    def forward(self, *args: Any) -> Any:
        return self.engine(*args) if self.engine is not None else self.module(*args)


class AdaptersOffReference:
    """The KL reference of a LoRA job: the policy itself with its adapters switched off, which is
    its base model exactly (no second copy in memory; under ZeRO-3 the same partitions)."""

    def __init__(self, policy: TrainEngine) -> None:
        self.policy = policy

    def resident(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to move: the policy's own weights (FrozenModel's interface)."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def forward(self, *args: Any) -> Any:
        from kuberl.common.lora import adapters_disabled

        with adapters_disabled(self.policy.module):
            return self.policy.forward(*args)


LossFn = Any  # Callable[[MicroBatch, Any], tuple[torch.Tensor, dict[str, float]]]


def run_micro_batches(
    engine: TrainEngine,
    batches: list[MicroBatch],
    loss_fn: LossFn,
    pad_id: int,
    names: tuple[str, ...] = (),
) -> tuple[float, list[tuple[dict[str, float], int]]]:
    """Forward and backward every micro-batch, then one optimizer step.

    The model computes its outputs at the micro-batch's response positions only (`gather_index`),
    so `loss_fn(micro_batch, outputs)` gets them response-aligned ([b, R, ...]) and returns the
    loss to differentiate (already scaled by the caller to its share of the global normaliser)
    and metrics for that micro-batch. Ranks with fewer micro-batches run padding ones with a
    zero loss, so all ranks make the same collective calls. Returns the grad norm and (metrics,
    tokens) of every real micro-batch of this rank.
    """
    count = all_reduce_max(len(batches), engine.dist)
    batches = batches + [
        padding_micro_batch(pad_id, engine.dist.device, names) for _ in range(count - len(batches))
    ]
    engine.train()
    records: list[tuple[dict[str, float], int]] = []
    for mb in batches:
        outputs = engine.forward(mb.input_ids, mb.attention_mask, mb.gather_index)
        if mb.is_padding:
            loss = outputs.sum() * 0.0
        else:
            loss, metrics = loss_fn(mb, outputs)
            records.append((metrics, mb.num_tokens))
        engine.backward(loss)
    return engine.step(), records


@torch.no_grad()
def run_forward(
    forward: Any, batches: list[MicroBatch], pad_id: int, dist_info: DistInfo
) -> list[Any]:
    """Response-aligned outputs of a no-grad forward over each micro-batch (padding ones run but
    are dropped)."""
    count = all_reduce_max(len(batches), dist_info)
    padded = batches + [
        padding_micro_batch(pad_id, dist_info.device) for _ in range(count - len(batches))
    ]
    outs = [forward(mb.input_ids, mb.attention_mask, mb.gather_index) for mb in padded]
    return outs[: len(batches)]
