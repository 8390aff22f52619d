"""The job file schema: defaults, the example job, env overrides and errors that name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kuberl.common.config import ConfigError, JobConfig, load_job_config, parse_job_config
from tests.support import REPO


def test_defaults_form_a_valid_job() -> None:
    assert parse_job_config({}, env={}).trainer.zero_stage == 0


def test_every_example_job_file_validates() -> None:
    examples = sorted((REPO / "examples").glob("*.yaml"))
    assert examples and all(isinstance(load_job_config(p, env={}), JobConfig) for p in examples)


def test_an_unknown_field_is_named_with_its_path() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.optimizer\.learning_rate: Extra inputs"):
        parse_job_config({"trainer": {"optimizer": {"learning_rate": 1e-3}}}, env={})


def test_a_wrong_value_names_the_path_the_expectation_and_the_value() -> None:
    with pytest.raises(
        ConfigError, match=r"trainer\.zero_stage: Input should be 0, 1, 2 or 3 \(got 7\)"
    ):
        parse_job_config({"trainer": {"zero_stage": 7}}, env={})


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        parse_job_config(
            {"trainer": {"zero_stage": 7}, "buffer": {"max_inflight_groups": 0}}, env={}
        )
    assert {"trainer.zero_stage", "buffer.max_inflight_groups"} <= {
        line.split(":")[0].strip() for line in str(err.value).splitlines()[1:]
    }


def test_env_overrides_a_nested_field_with_a_typed_value() -> None:
    env = {"KUBERL_BUFFER__SERVER__PORT": "6000", "KUBERL_TRAINER__OPTIMIZER__LR": "3e-4"}
    config = parse_job_config({"buffer": {"server": {"port": 1}}}, env=env)
    assert (config.buffer.server.port, config.trainer.optimizer.lr) == (6000, 3e-4)


def test_env_override_errors_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="from environment KUBERL_ROLLOUT__GROUP_SIZE"):
        parse_job_config({}, env={"KUBERL_ROLLOUT__GROUP_SIZE": "many"})


@pytest.mark.parametrize(
    ("name", "raw", "read"),
    [
        # Text fields take the value as written: YAML read these as 'answer' (a comment), a
        # number and a bool, or failed with a traceback naming nothing.
        ("KUBERL_REWARD__FORMAT_PATTERN", r"answer #\d+", r"answer #\d+"),
        ("KUBERL_REWARD__FORMAT_PATTERN", "[A-Z]+ done", "[A-Z]+ done"),
        ("KUBERL_MODEL__PATH", "*models", "*models"),
        ("KUBERL_ROLLOUT__REPLICA_ID", "no", "no"),
        ("KUBERL_ROLLOUT__REPLICA_ID", "null", None),  # an optional text field can be cleared
        ("KUBERL_TRAINER__MODE", "sft", "sft"),
        ("KUBERL_TRAINER__TOTAL_STEPS", "7", 7),  # other fields are still YAML
        ("KUBERL_REWARD__VERIFIERS", "{gsm8k: 1.0}", {"gsm8k": 1.0}),
    ],
)
def test_env_overrides_of_text_fields_are_taken_as_written(
    name: str, raw: str, read: object
) -> None:
    config = parse_job_config({}, env={name: raw})
    section, field = name.removeprefix("KUBERL_").lower().split("__")
    assert getattr(getattr(config, section), field) == read


def test_an_env_override_that_is_not_yaml_names_the_variable() -> None:
    with pytest.raises(
        ConfigError, match="environment KUBERL_BUFFER__MAX_INFLIGHT_GROUPS: .*quote"
    ):
        parse_job_config({}, env={"KUBERL_BUFFER__MAX_INFLIGHT_GROUPS": "[A-Z]+ done"})


def test_env_with_an_unknown_section_is_an_error() -> None:
    with pytest.raises(ConfigError, match="unknown section 'bufer'"):
        parse_job_config({}, env={"KUBERL_BUFER__PORT": "1"})


def test_variables_without_a_section_separator_are_not_overrides() -> None:
    assert parse_job_config({}, env={"KUBERL_LOG_LEVEL": "debug"}).job.name == "kuberl"


def test_the_engine_is_chosen_by_its_kind() -> None:
    config = parse_job_config({"rollout": {"engine": {"kind": "sglang", "tp_size": 2}}}, env={})
    assert (config.rollout.engine.kind, config.rollout.engine.tp_size) == ("sglang", 2)


@pytest.mark.parametrize(
    ("doc", "env"),
    [
        ({"rollout": {"engine": {"max_batch_size": 4}}}, {}),
        ({}, {"KUBERL_ROLLOUT__ENGINE__DEVICE": "cpu"}),
    ],
)
def test_an_engine_section_without_its_kind_is_the_default_torch_engine(
    doc: dict[str, Any], env: dict[str, str]
) -> None:
    # Refused as "Unable to extract tag using discriminator 'kind'" once.
    assert parse_job_config(doc, env=env).rollout.engine.kind == "torch"


def test_an_unknown_engine_kind_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="rollout.engine: .*'torch', 'sglang'"):
        parse_job_config({"rollout": {"engine": {"kind": "vllm"}}}, env={})


def test_group_methods_need_at_least_two_samples_per_prompt() -> None:
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        parse_job_config({"rollout": {"group_size": 1}}, env={})


def test_a_job_name_must_be_a_dns_label() -> None:
    with pytest.raises(ConfigError, match="job.name"):
        parse_job_config({"job": {"name": "My Job"}}, env={})


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the job file"):
        load_job_config(tmp_path / "nope.yaml", env={})


def test_a_file_that_is_not_a_mapping_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_job_config(path, env={})


def test_compiled_layers_are_refused_with_zero3_and_the_reason() -> None:
    ok = parse_job_config({"trainer": {"compile_model": True, "zero_stage": 2}}, env={})
    assert ok.trainer.compile_model
    with pytest.raises(ConfigError, match="compile_model needs zero_stage 0-2"):
        parse_job_config({"trainer": {"compile_model": True, "zero_stage": 3}}, env={})


def test_parsing_never_changes_the_callers_document() -> None:
    # kuberl run parsed its job once per service with that service's overrides: the job.yaml it
    # then wrote held the last rollout replica's id, ports and seed.
    doc = {"rollout": {"group_size": 4}}
    job = parse_job_config(doc, env={"KUBERL_ROLLOUT__REPLICA_ID": "rollout-1"})
    assert (job.rollout.replica_id, doc) == ("rollout-1", {"rollout": {"group_size": 4}})
