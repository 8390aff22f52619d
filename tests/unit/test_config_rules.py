"""The cross-section rules of the job file: each named rule refuses a job that breaks it, with a
message naming the fields involved, and lets the default job through."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kuberl.common.config import JOB_RULES, ConfigError, JobConfig, parse_job_config, rules

SGLANG = {"kind": "sglang", "url": "http://127.0.0.1:30000"}

# rule -> (a job breaking only that rule, the field paths its message must name)
BREAKING: dict[str, tuple[dict[str, Any], list[str]]] = {
    "group_advantages_need_groups": (
        {"rollout": {"group_size": 1}, "trainer": {"algorithm": {"advantage": "rloo"}}},
        ["rollout.group_size", "'rloo'"],
    ),
    "staleness_covers_publish_interval": (
        {"trainer": {"publish_every": 4, "max_staleness": 1}},
        ["trainer.publish_every", "trainer.max_staleness"],
    ),
    "dynamic_sampling_needs_groups": (
        {
            "buffer": {"dynamic_sampling": True},
            "rollout": {"group_size": 1},
            "trainer": {"algorithm": {"advantage": "reinforce_pp"}},
        },
        ["buffer.dynamic_sampling", "rollout.group_size"],
    ),
    "dynamic_sampling_needs_random_sampling": (
        {"buffer": {"dynamic_sampling": True}, "rollout": {"sampling": {"temperature": 0}}},
        ["buffer.dynamic_sampling", "rollout.sampling.temperature"],
    ),
    "cpu_local_run_uses_no_gpu": (
        {"job": {"local": {"device": "cpu"}}, "rollout": {"engine": {"device": "cuda"}}},
        ["rollout.engine.device", "job.local.device"],
    ),
    "sglang_ignore_eos_keeps_stop_ids": (
        {"rollout": {"engine": SGLANG, "sampling": {"ignore_eos": True, "stop_token_ids": [2]}}},
        ["rollout.sampling.ignore_eos", "stop_token_ids"],
    ),
    "sglang_engines_have_a_weight_route": (
        {"rollout": {"engine": SGLANG}, "weight_sync": {"transports": ["gloo", "shm"]}},
        ["weight_sync.transports", "rollout.engine.kind"],
    ),
    "lora_sglang_engines_receive_adapters_in_process": (
        {
            "model": {"lora": {}},
            "rollout": {"engine": SGLANG},
            "weight_sync": {"transports": ["cuda_ipc", "nccl"], "device": "cuda"},
        },
        ["weight_sync.transports", "model.lora", "rollout.engine.kind", "add shm"],
    ),
    "lora_targets_are_modules_sglang_adapts": (
        {
            "model": {"lora": {"target_modules": ["q_proj", "c_attn"]}},
            "rollout": {"engine": SGLANG},
        },
        ["model.lora.target_modules", "['c_attn']", "rollout.engine.kind"],
    ),
    "lora_fits_the_sglang_launch_args": (
        {
            "model": {"lora": {"rank": 64}},
            "rollout": {"engine": {**SGLANG, "launch_args": ["--max-lora-rank", "32"]}},
        },
        ["model.lora.rank 64", "rollout.engine.launch_args", "--max-lora-rank 32"],
    ),
}


def test_every_rule_is_run_by_the_job_and_has_a_case_here() -> None:
    assert sorted(rule.__name__ for rule in JOB_RULES) == sorted(BREAKING)


@pytest.mark.parametrize("name", sorted(BREAKING))
def test_a_job_breaking_a_rule_is_refused_naming_the_fields(name: str) -> None:
    doc, fields = BREAKING[name]
    with pytest.raises(ValueError) as direct:
        getattr(rules, name)(JobConfig.model_construct(**_sections(doc)))
    with pytest.raises(ConfigError) as parsed:
        parse_job_config(doc, env={})
    for field in fields:
        assert field in str(direct.value)
    assert str(direct.value) in str(parsed.value)


@pytest.mark.parametrize("rule", JOB_RULES, ids=lambda r: r.__name__)
def test_the_default_job_keeps_every_rule(rule: rules.JobRule) -> None:
    rule(JobConfig())


def test_a_cpu_local_run_refuses_gpu_only_transports() -> None:
    doc = {"job": {"local": {"device": "cpu"}}, "weight_sync": {"transports": ["nccl"]}}
    with pytest.raises(ConfigError, match=r"weight_sync.transports \['nccl'\] needs GPUs"):
        parse_job_config(doc, env={})


def test_sglang_with_only_nccl_needs_a_gpu_relay() -> None:
    doc = {"rollout": {"engine": SGLANG}, "weight_sync": {"transports": ["nccl"]}}
    with pytest.raises(ConfigError, match="weight_sync.device is cpu"):
        parse_job_config(doc, env={})


def test_lora_on_sglang_without_nccl_is_not_asked_for_a_gpu_relay() -> None:
    # Adapters never travel by nccl, so the full-weight rule's demand does not apply.
    doc = {
        "model": {"lora": {}},
        "rollout": {"engine": SGLANG},
        "weight_sync": {"transports": ["shm", "gloo"]},
    }
    assert parse_job_config(doc, env={}).model.lora is not None


@pytest.mark.parametrize(
    ("launch_args", "refusal"),
    [
        (["--lora-target-modules", "q_proj", "v_proj"], "'k_proj', 'o_proj'"),
        (["--lora-target-modules=q_proj"], "without ['down_proj'"),
        (["--dp-size", "2"], "--dp-size 2"),
        (["--data-parallel-size", "4", "--max-lora-rank", "8"], "--data-parallel-size 4"),
    ],
)
def test_launch_args_that_leave_no_room_for_the_jobs_adapters_are_refused(
    launch_args: list[str], refusal: str
) -> None:
    doc = {
        "model": {"lora": {"rank": 8}},
        "rollout": {"engine": {**SGLANG, "launch_args": launch_args}},
    }
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        parse_job_config(doc, env={})


@pytest.mark.parametrize(
    "launch_args",
    [
        ["--max-lora-rank", "64", "--lora-target-modules", "all"],
        ["--max-lora-rank=16", "--dp-size", "1", "--context-length", "4096"],
    ],
)
def test_launch_args_with_room_for_the_jobs_adapters_pass(launch_args: list[str]) -> None:
    doc = {
        "model": {"lora": {"rank": 16}},
        "rollout": {"engine": {**SGLANG, "launch_args": launch_args}},
    }
    assert parse_job_config(doc, env={}).rollout.engine.launch_args == launch_args  # type: ignore[union-attr]


def test_lora_on_the_torch_engine_is_held_to_none_of_sglangs_limits() -> None:
    doc = {
        "model": {"lora": {"target_modules": ["c_attn"]}},
        "weight_sync": {"transports": ["nccl"], "device": "cuda"},
    }
    assert parse_job_config(doc, env={}).model.lora is not None


def _sections(doc: dict[str, Any]) -> dict[str, Any]:
    """The validated sections of `doc`, for calling one rule without the others running."""
    full = JobConfig.model_validate({}).model_dump()
    for section, value in doc.items():
        full[section] = _merge(full[section], value)
    fields = JobConfig.model_fields
    out = {}
    for name, value in full.items():
        annotation = fields[name].annotation
        assert isinstance(annotation, type)
        out[name] = annotation.model_validate(value)
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = (
            _merge(base[key], value)
            if isinstance(value, dict) and isinstance(base.get(key), dict) and key != "engine"
            else value
        )
    return out
