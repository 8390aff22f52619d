"""The contract of the advantage-estimator extension point (`trainer.algorithm.advantage`).

An estimator is `fn(inputs: AdvantageInputs, config: AlgorithmConfig) -> (advantages, returns)`,
both [B, T]. A job names a registered one or a plugin `package.module:function`; the built-ins
are registered under the names the config accepts; names are unique; a plugin's signature is
checked when it is loaded, and every failure names the field.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from kuberl.common.config import (
    BUILTIN_ADVANTAGES,
    AlgorithmConfig,
    ConfigError,
    parse_job_config,
)
from kuberl.common.plugins import PluginError
from kuberl.trainer import algorithms as algo

PLUGINS = "tests.plugin_contracts.algorithm_plugins"
FIELD = "trainer.algorithm.advantage"


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> algo.Registry[algo.AdvantageEstimator]:
    """The real registry, restored after the test."""
    reg = algo.ADVANTAGE_ESTIMATORS
    monkeypatch.setattr(reg, "_named", dict(reg._named))
    monkeypatch.setattr(algo, "_NEEDS_CRITIC", set(algo._NEEDS_CRITIC))
    return reg


def _batch() -> tuple[Tensor, Tensor]:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])  # [B], two groups of 2
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])  # [B, T]
    return rewards, mask


def _estimator(inputs: algo.AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    return inputs.rewards[:, None].expand_as(inputs.mask), inputs.token_rewards


def test_the_builtins_are_registered_under_the_names_the_config_accepts() -> None:
    assert algo.ADVANTAGE_ESTIMATORS.names() == sorted(BUILTIN_ADVANTAGES)


def test_a_registered_estimator_is_resolved_by_name(registry: Any) -> None:
    algo.register_advantage("reward_as_advantage")(_estimator)
    assert registry.resolve("reward_as_advantage", FIELD) is _estimator


def test_a_name_taken_by_another_estimator_is_refused(registry: Any) -> None:
    with pytest.raises(PluginError, match=r"advantage estimator 'grpo' is already registered"):
        algo.register_advantage("grpo")(_estimator)


def test_registering_the_same_function_twice_is_harmless(registry: Any) -> None:
    algo.register_advantage("twice")(_estimator)
    algo.register_advantage("twice")(_estimator)
    assert registry.resolve("twice", FIELD) is _estimator


def test_registering_a_function_of_the_wrong_signature_is_refused(registry: Any) -> None:
    def rewards_only(rewards: Tensor) -> Tensor:
        return rewards

    with pytest.raises(PluginError, match=r"kuberl calls it as rewards_only\(inputs, config\)"):
        algo.register_advantage("rewards_only")(rewards_only)  # type: ignore[arg-type]


def test_a_plugin_path_is_loaded_and_used_by_compute_advantages() -> None:
    rewards, mask = _batch()
    config = AlgorithmConfig(advantage=f"{PLUGINS}:constant_advantages")
    advantages, returns = algo.compute_advantages(config, rewards, mask, group_size=2)
    assert torch.equal(advantages, 0.25 * mask.float())  # 0 off the mask
    assert torch.equal(returns, rewards[:, None] * mask.float())


def test_a_plugin_of_the_wrong_signature_is_an_error_naming_field_and_signature() -> None:
    config = AlgorithmConfig(advantage=f"{PLUGINS}:one_argument")
    with pytest.raises(PluginError) as err:
        algo.resolve_algorithm(config)
    assert FIELD in str(err.value) and "one_argument(inputs, config)" in str(err.value)


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (f"{PLUGINS}_missing:fn", "not found"),
        (f"{PLUGINS}:no_such_function", "has no attribute"),
        (f"{PLUGINS}:NOT_CALLABLE", "not callable"),
    ],
)
def test_a_plugin_that_cannot_be_loaded_names_the_field(spec: str, problem: str) -> None:
    with pytest.raises(PluginError, match=problem) as err:
        algo.resolve_algorithm(AlgorithmConfig(advantage=spec))
    assert str(err.value).startswith(FIELD)


def test_an_unknown_name_lists_the_registered_ones_and_the_plugin_syntax() -> None:
    with pytest.raises(PluginError) as err:
        algo.ADVANTAGE_ESTIMATORS.resolve("grpoo", FIELD)
    message = str(err.value)
    assert all(name in message for name in BUILTIN_ADVANTAGES)
    assert FIELD in message and "'package.module:function'" in message


def test_the_job_file_refuses_an_unknown_name_naming_the_field() -> None:
    doc = {"trainer": {"algorithm": {"advantage": "grpoo"}}}
    with pytest.raises(ConfigError, match=rf"{FIELD}: .*unknown advantage estimator 'grpoo'"):
        parse_job_config(doc, env={})


def test_an_estimator_registered_with_a_critic_gets_one(registry: Any) -> None:
    algo.register_advantage("with_critic", needs_critic=True)(_estimator)
    named = [AlgorithmConfig.model_construct(advantage=n) for n in ("with_critic", "gae", "grpo")]
    assert [algo.resolve_algorithm(c).needs_critic for c in named] == [True, True, False]


def test_an_estimator_returning_the_wrong_shape_is_refused(registry: Any) -> None:
    def per_sequence(
        inputs: algo.AdvantageInputs, config: AlgorithmConfig
    ) -> tuple[Tensor, Tensor]:
        return inputs.rewards, inputs.rewards  # [B], not [B, T]

    algo.register_advantage("per_sequence")(per_sequence)
    rewards, mask = _batch()
    config = AlgorithmConfig.model_construct(advantage="per_sequence")
    with pytest.raises(ValueError, match=r"advantages has shape \(4,\) but mask has \(4, 3\)"):
        algo.compute_advantages(config, rewards, mask, group_size=2)
