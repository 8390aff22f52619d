"""The contract of the policy-loss extension point (`trainer.algorithm.policy_loss`).

A loss is `fn(inputs: PolicyLossInputs, config: AlgorithmConfig) -> (loss [B, T], stats)`; the
trainer weights (TIS/MIS) and aggregates the per-token loss, reports "ratio" / "clipped" /
"dual_clipped" stats as the policy/* figures and any other per-token stat as its masked mean
`policy/<name>`. A job names a registered loss or a plugin; names are unique; a plugin's signature
is checked when it is loaded, and every failure names the field.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from kuberl.common.config import (
    BUILTIN_POLICY_LOSSES,
    AlgorithmConfig,
    ConfigError,
    parse_job_config,
)
from kuberl.common.plugins import PluginError
from kuberl.trainer import algorithms as algo

PLUGINS = "tests.plugin_contracts.algorithm_plugins"
FIELD = "trainer.algorithm.policy_loss"


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> algo.Registry[algo.PolicyLoss]:
    """The real registry, restored after the test."""
    reg = algo.POLICY_LOSSES
    monkeypatch.setattr(reg, "_named", dict(reg._named))
    return reg


def _loss(
    inputs: algo.PolicyLossInputs, config: AlgorithmConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    return -inputs.advantages * inputs.logprobs, {}


def _step(config: AlgorithmConfig) -> tuple[Tensor, dict[str, float]]:
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)  # [B, T]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # [B, T]
    advantages = torch.tensor([[1.0, 1.0, 0.0], [-2.0, 0.0, 0.0]])  # [B, T]
    config = config.model_copy(
        update={"importance": config.importance.model_copy(update={"mode": "none"})}
    )
    return algo.policy_loss_and_metrics(config, logprobs, None, logprobs.detach(), advantages, mask)


def test_the_builtins_are_registered_under_the_names_the_config_accepts() -> None:
    assert algo.POLICY_LOSSES.names() == sorted(BUILTIN_POLICY_LOSSES)


def test_a_registered_loss_is_resolved_by_name(registry: Any) -> None:
    algo.register_policy_loss("pg")(_loss)
    assert registry.resolve("pg", FIELD) is _loss


def test_a_name_taken_by_another_loss_is_refused(registry: Any) -> None:
    with pytest.raises(PluginError, match=r"policy loss 'ppo' is already registered"):
        algo.register_policy_loss("ppo")(_loss)


def test_a_name_with_a_colon_is_refused_as_a_name() -> None:
    with pytest.raises(PluginError, match="':' marks plugin paths"):
        algo.register_policy_loss("my:loss")


def test_registering_a_function_of_the_wrong_signature_is_refused(registry: Any) -> None:
    def three(logprobs: Tensor, old: Tensor, advantages: Tensor) -> Tensor:
        return logprobs

    with pytest.raises(PluginError, match=r"kuberl calls it as three\(inputs, config\)"):
        algo.register_policy_loss("three")(three)  # type: ignore[arg-type]


def test_a_plugin_path_is_the_loss_and_its_own_stats_are_reported() -> None:
    # -A * log pi over the 3 tokens: (1 * 1 + 1 * 2 + -2 * 0.5) / 3 = 2 / 3 (token_mean)
    loss, metrics = _step(AlgorithmConfig(policy_loss=f"{PLUGINS}:vanilla_pg_loss"))
    assert loss.item() == pytest.approx(2 / 3)
    assert metrics["policy/marker"] == 3.0
    assert (metrics["policy/clip_frac"], metrics["policy/ratio_mean"]) == (0.0, 1.0)


def test_a_builtin_loss_reports_no_extra_stats() -> None:
    _, metrics = _step(AlgorithmConfig(policy_loss="ppo"))
    assert "policy/marker" not in metrics and "policy/ratio" not in metrics


def test_a_plugin_of_the_wrong_signature_is_an_error_naming_field_and_signature() -> None:
    config = AlgorithmConfig(policy_loss=f"{PLUGINS}:one_argument")
    with pytest.raises(PluginError) as err:
        algo.resolve_algorithm(config)
    assert FIELD in str(err.value) and "one_argument(inputs, config)" in str(err.value)


def test_an_unknown_name_lists_the_registered_ones_and_the_plugin_syntax() -> None:
    with pytest.raises(PluginError) as err:
        algo.POLICY_LOSSES.resolve("ppo2", FIELD)
    message = str(err.value)
    assert all(name in message for name in BUILTIN_POLICY_LOSSES)
    assert FIELD in message and "'package.module:function'" in message


def test_the_job_file_refuses_an_unknown_name_naming_the_field() -> None:
    doc = {"trainer": {"algorithm": {"policy_loss": "ppo2"}}}
    with pytest.raises(ConfigError, match=rf"{FIELD}: .*unknown policy loss 'ppo2'"):
        parse_job_config(doc, env={})


def test_a_loss_returning_the_wrong_shape_is_refused(registry: Any) -> None:
    def scalar(
        inputs: algo.PolicyLossInputs, config: AlgorithmConfig
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return inputs.logprobs.sum(), {}

    algo.register_policy_loss("scalar")(scalar)
    with pytest.raises(ValueError, match=r"loss has shape \(\) but mask has \(2, 3\)"):
        _step(AlgorithmConfig.model_construct(policy_loss="scalar"))
