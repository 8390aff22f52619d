"""A LoRA job's SGLang container: launched with LoRA on and room for the job's adapters, the same
flags the replica's own launch passes (`lora_launch_args`), and no GPU for the weight-sync relay
(adapters never go by NCCL)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kuberl.common.config import LoraConfig
from kuberl.rollout.engine.sglang import lora_launch_args
from tests.helm.chart import pod_spec, render


def _sglang_args(lora: dict[str, Any] | None) -> list[str]:
    rollout = render("defaults", job={"model": {"lora": lora}}).get("Deployment", "rollout")
    container = next(c for c in pod_spec(rollout)["containers"] if c["name"] == "sglang")
    return [str(a) for a in container["args"]]


def _lora_part(args: list[str]) -> list[str]:
    if "--enable-lora" not in args:
        return []
    start = args.index("--enable-lora")
    return args[start : args.index("--max-loras-per-batch") + 2]


@pytest.mark.parametrize(
    "lora",
    [{}, {"rank": 64}, {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}],
)
def test_sglang_starts_with_the_flags_the_replicas_own_launch_passes(lora: dict[str, Any]) -> None:
    assert _lora_part(_sglang_args(lora)) == lora_launch_args(LoraConfig(**lora))


def test_a_full_training_job_starts_sglang_without_lora() -> None:
    assert _lora_part(_sglang_args(None)) == []


def test_a_lora_job_gives_the_weight_sync_relay_no_gpu() -> None:
    def device(job: dict[str, Any]) -> Any:
        rendered = render("defaults", job=job)
        config = next(d for d in rendered.all("ConfigMap") if "job.yaml" in (d.get("data") or {}))
        return yaml.safe_load(config["data"]["job.yaml"])["weight_sync"].get("device")

    assert (device({}), device({"model": {"lora": {}}})) == ("cuda", None)


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        (["--max-lora-rank", "64"], "job.model.lora.rank"),
        (["--lora-target-modules=q_proj"], "job.model.lora.target_modules"),
        (["--max-loras-per-batch", "1"], "two adapters per batch"),
        (["--tp-size", "2"], "rollout.sglang.tpSize"),
        (["--port=31000"], "rollout.sglang.port"),
    ],
)
def test_extra_args_may_not_override_a_flag_the_chart_sets(extra: list[str], names: str) -> None:
    from helm_python import HelmRenderError

    flag = extra[0].split("=")[0]
    with pytest.raises(HelmRenderError, match=f"extraArgs: {flag} is set by the chart.*{names}"):
        render("defaults", job={"model": {"lora": {}}}, rollout={"sglang": {"extraArgs": extra}})


def test_other_extra_args_reach_sglang_after_the_charts_own() -> None:
    extra = ["--chunked-prefill-size", "4096", "--disable-radix-cache"]
    rendered = render(
        "defaults", job={"model": {"lora": {}}}, rollout={"sglang": {"extraArgs": extra}}
    )
    container = next(
        c
        for c in pod_spec(rendered.get("Deployment", "rollout"))["containers"]
        if c["name"] == "sglang"
    )
    assert [str(a) for a in container["args"]][-3:] == extra
