"""Rules that span sections: combinations valid field by field that can never run.

Each rule is one function named for what it requires; it takes the whole job and raises
ValueError naming the fields involved and the fix. `JobConfig` runs `JOB_RULES` in order after
every section has validated, so the first broken rule is the one reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kuberl.common.config.rollout import (
    SGLANG_LORA_TARGET_MODULES,
    SGLangEngineConfig,
    TorchEngineConfig,
)

if TYPE_CHECKING:
    from kuberl.common.config.jobfile import JobConfig

#: Built-in advantage estimators that compare the samples of a group with each other.
GROUP_ADVANTAGES = ("grpo", "drgrpo", "rloo")


def group_advantages_need_groups(job: JobConfig) -> None:
    advantage = job.trainer.algorithm.advantage
    if advantage in GROUP_ADVANTAGES and job.rollout.group_size < 2:
        raise ValueError(
            f"rollout.group_size must be >= 2 for advantage {advantage!r} "
            f"(got {job.rollout.group_size})"
        )


def staleness_covers_publish_interval(job: JobConfig) -> None:
    t = job.trainer
    if t.mode == "rl" and t.publish_weights and 0 <= t.max_staleness < t.publish_every - 1:
        # After step 1 the trainer is at v1, the engines at v0 until v{publish_every}.
        raise ValueError(
            f"trainer.publish_every {t.publish_every} with trainer.max_staleness "
            f"{t.max_staleness}: between two publishes the engines fall up to "
            f"{t.publish_every - 1} versions behind, so every group they generate is dropped "
            "as stale and training stops; set max_staleness >= publish_every - 1 (or -1), or "
            "a smaller publish_every"
        )


def dynamic_sampling_needs_groups(job: JobConfig) -> None:
    if job.buffer.dynamic_sampling and job.rollout.group_size < 2:
        raise ValueError(
            "buffer.dynamic_sampling with rollout.group_size 1: a group of one sample has no "
            "reward variance, so every group is dropped and training never starts; set "
            "group_size >= 2 or buffer.dynamic_sampling: false"
        )


def dynamic_sampling_needs_random_sampling(job: JobConfig) -> None:
    r = job.rollout
    if (
        job.buffer.dynamic_sampling
        and r.sampling.temperature == 0
        and r.group_size > 1
        and r.rollout_function is None
    ):
        raise ValueError(
            "buffer.dynamic_sampling with rollout.sampling.temperature 0: greedy sampling "
            "gives every sample of a group the same response and reward, so every group is "
            "dropped and training never starts; set rollout.sampling.temperature > 0 (e.g. "
            "1.0) or buffer.dynamic_sampling: false"
        )


def cpu_local_run_uses_no_gpu(job: JobConfig) -> None:
    """`job.local.device: cpu` written out: `kuberl run` hides CUDA, so GPU settings cannot work."""
    local = job.job.local
    if "device" not in local.model_fields_set or local.device != "cpu":
        return
    fix = "or set job.local.device: cuda on a machine with a GPU"
    transports = set(job.weight_sync.transports)
    if transports and transports <= {"nccl", "cuda_ipc"}:
        raise ValueError(
            f"weight_sync.transports {job.weight_sync.transports} needs GPUs but "
            f"job.local.device is cpu: add gloo, shm or snapshot, {fix}"
        )
    engine = job.rollout.engine
    if isinstance(engine, TorchEngineConfig) and engine.device.startswith("cuda"):
        raise ValueError(
            f"rollout.engine.device {engine.device!r} but job.local.device is cpu: set "
            f"rollout.engine.device: cpu, {fix}"
        )
    if isinstance(engine, SGLangEngineConfig) and engine.launch:
        raise ValueError(
            "rollout.engine.launch starts an SGLang server, which needs a GPU, but "
            f"job.local.device is cpu: use rollout.engine.kind: torch, {fix}"
        )
    rm = job.reward.reward_model
    if rm is not None and rm.device.startswith("cuda"):
        raise ValueError(
            f"reward.reward_model.device {rm.device!r} but job.local.device is cpu: set "
            f"reward.reward_model.device: cpu, {fix}"
        )


def sglang_ignore_eos_keeps_stop_ids(job: JobConfig) -> None:
    r = job.rollout
    if (
        isinstance(r.engine, SGLangEngineConfig)
        and r.sampling.ignore_eos
        and r.sampling.stop_token_ids
    ):
        raise ValueError(
            "rollout.sampling.ignore_eos with stop_token_ids on the sglang engine: SGLang "
            "ignores the stop token ids too under ignore_eos (every sample would run to "
            "max_new_tokens); drop ignore_eos or the stop ids"
        )


def sglang_engines_have_a_weight_route(job: JobConfig) -> None:
    """An SGLang engine takes a version by NCCL or from a snapshot (CUDA IPC only on the
    trainer's GPU); the relay sends NCCL only from a GPU (`weight_sync.device`)."""
    ws = job.weight_sync
    if not isinstance(job.rollout.engine, SGLangEngineConfig) or "snapshot" in ws.transports:
        return
    if job.model.lora is not None:
        return  # adapters come another way: lora_sglang_engines_receive_adapters_in_process
    if "nccl" not in ws.transports:
        raise ValueError(
            f"weight_sync.transports {ws.transports} names neither route SGLang engines "
            "(rollout.engine.kind: sglang) take, nccl or snapshot: add nccl (with "
            "weight_sync.device: cuda) or snapshot"
        )
    if ws.device == "cpu":
        raise ValueError(
            f"weight_sync.transports {ws.transports} makes nccl the only route to SGLang "
            "engines (rollout.engine.kind: sglang), but weight_sync.device is cpu and the "
            "relay sends NCCL only from a GPU, so every version would reach them by "
            "snapshot, which the list leaves out: set weight_sync.device: cuda (the Helm "
            "chart then gives the weight-sync pod a GPU), or add snapshot to "
            "weight_sync.transports"
        )


#: Where a LoRA job's SGLang replica can receive an adapter in its own process.
ADAPTER_ROUTES = ("shm", "gloo", "snapshot")


def lora_sglang_engines_receive_adapters_in_process(job: JobConfig) -> None:
    """With `model.lora` the SGLang replica receives each adapter itself and hands SGLang a PEFT
    folder: nccl and cuda_ipc, which SGLang takes into its base weights, cannot carry it."""
    transports = job.weight_sync.transports
    if (
        job.model.lora is None
        or not isinstance(job.rollout.engine, SGLangEngineConfig)
        or set(transports) & set(ADAPTER_ROUTES)
    ):
        return
    raise ValueError(
        f"weight_sync.transports {transports} with model.lora on SGLang engines "
        "(rollout.engine.kind: sglang): LoRA adapters reach the rollout process by shm, gloo "
        "or snapshot and go to SGLang as files, never by nccl or cuda_ipc; add shm (same host) "
        "or snapshot to weight_sync.transports"
    )


def lora_targets_are_modules_sglang_adapts(job: JobConfig) -> None:
    lora = job.model.lora
    if lora is None or not isinstance(job.rollout.engine, SGLangEngineConfig):
        return
    unknown = [m for m in lora.target_modules if m not in SGLANG_LORA_TARGET_MODULES]
    if unknown:
        raise ValueError(
            f"model.lora.target_modules {unknown} on SGLang engines (rollout.engine.kind: "
            "sglang): SGLang 0.5.23 puts adapters only on "
            f"{', '.join(SGLANG_LORA_TARGET_MODULES)}; train adapters on those (e.g. "
            "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or use the torch "
            "engine"
        )


def lora_fits_the_sglang_launch_args(job: JobConfig) -> None:
    """The replica launches SGLang with memory for the job's adapters; flags in
    `rollout.engine.launch_args` come last and override those, so they must still fit."""
    lora, engine = job.model.lora, job.rollout.engine
    if lora is None or not isinstance(engine, SGLangEngineConfig):
        return
    args = engine.launch_args
    rank = _launch_option(args, "--max-lora-rank")
    if rank and rank[-1].isdigit() and int(rank[-1]) < lora.rank:
        raise ValueError(
            f"model.lora.rank {lora.rank} but rollout.engine.launch_args sets --max-lora-rank "
            f"{rank[-1]}: SGLang refuses every adapter of a higher rank; drop the flag (the "
            "replica passes the job's rank) or lower model.lora.rank"
        )
    targets = _launch_option(args, "--lora-target-modules")
    missing = sorted(set(lora.target_modules) - set(targets or ())) if targets else []
    if missing and "all" not in (targets or ()):
        raise ValueError(
            f"rollout.engine.launch_args sets --lora-target-modules {targets}, without "
            f"{missing} of model.lora.target_modules: SGLang refuses adapters on modules it has "
            "no memory for; drop the flag (the replica passes the job's modules) or add them"
        )
    for flag in ("--dp-size", "--data-parallel-size"):
        dp = _launch_option(args, flag)
        if dp and dp[-1].isdigit() and int(dp[-1]) > 1:
            raise ValueError(
                f"rollout.engine.launch_args sets {flag} {dp[-1]} with model.lora: SGLang "
                "0.5.23 loads adapters at run time only into a server with one data-parallel "
                "replica; run more rollout replicas instead of --dp-size"
            )


def _launch_option(args: list[str], flag: str) -> list[str] | None:
    """The values the last `flag` (`--flag v ...` or `--flag=v`) in `args` takes; None if absent."""
    found = None
    for i, arg in enumerate(args):
        if arg == flag:
            rest = args[i + 1 :]
            end = next((k for k, a in enumerate(rest) if a.startswith("--")), len(rest))
            found = rest[:end]
        elif arg.startswith(flag + "="):
            found = [arg.split("=", 1)[1]]
    return found


JobRule = Callable[["JobConfig"], None]

JOB_RULES: tuple[JobRule, ...] = (
    group_advantages_need_groups,
    staleness_covers_publish_interval,
    dynamic_sampling_needs_groups,
    dynamic_sampling_needs_random_sampling,
    cpu_local_run_uses_no_gpu,
    sglang_ignore_eos_keeps_stop_ids,
    sglang_engines_have_a_weight_route,
    lora_sglang_engines_receive_adapters_in_process,
    lora_targets_are_modules_sglang_adapts,
    lora_fits_the_sglang_launch_args,
)
