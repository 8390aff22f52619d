"""Command-line overrides (`kuberl run job.yaml trainer.optimizer.lr=1e-6`) and the "did you
mean" that points a wrong key at the closest field across sections."""

from __future__ import annotations

from pathlib import Path

import pytest

from kuberl.cli import main
from kuberl.common.config import ConfigError, load_job_config, parse_job_config


def test_a_dotted_override_sets_a_nested_field_with_its_type() -> None:
    config = parse_job_config({}, env={}, overrides=["trainer.optimizer.lr=1e-6"])
    assert config.trainer.optimizer.lr == 1e-6


def test_an_override_wins_over_the_environment() -> None:
    config = parse_job_config(
        {}, env={"KUBERL_TRAINER__TOTAL_STEPS": "5"}, overrides=["trainer.total_steps=7"]
    )
    assert config.trainer.total_steps == 7


def test_an_override_indexes_a_list_element() -> None:
    doc = {"data": {"train": [{"path": "a.jsonl"}, {"path": "b.jsonl"}]}}
    config = parse_job_config(doc, env={}, overrides=["data.train[1].limit=3"])
    assert [d.limit for d in config.data.train] == [0, 3]


def test_an_override_past_the_end_of_a_list_names_the_valid_indices() -> None:
    doc = {"data": {"train": [{"path": "a.jsonl"}]}}
    with pytest.raises(ConfigError, match=r"data.train is a list of 1; index it with 0..0"):
        parse_job_config(doc, env={}, overrides=["data.train.1.limit=3"])


def test_an_override_without_a_value_shows_the_form() -> None:
    with pytest.raises(ConfigError, match=r"expected section.field=value"):
        parse_job_config({}, env={}, overrides=["trainer.total_steps"])


def test_overrides_of_text_fields_are_taken_as_written() -> None:
    config = parse_job_config({}, env={}, overrides=["rollout.replica_id=no"])
    assert config.rollout.replica_id == "no"


@pytest.mark.parametrize(
    ("env", "overrides"),
    [({"KUBERL_TRAINER__LR": "abc"}, []), ({}, ["trainer.lr=1e-6"]), ({}, ["lr=1e-6"])],
)
def test_a_misplaced_key_points_at_the_field_of_that_name(
    env: dict[str, str], overrides: list[str]
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_job_config({}, env=env, overrides=overrides)
    assert "did you mean 'trainer.optimizer.lr'?" in str(err.value)
    assert "known fields here" not in str(err.value)


def test_a_misspelt_field_still_gets_the_local_suggestion() -> None:
    with pytest.raises(ConfigError, match="did you mean 'total_steps'"):
        parse_job_config({}, env={}, overrides=["trainer.total_step=3"])


def test_the_error_says_which_override_set_the_value() -> None:
    with pytest.raises(ConfigError, match=r"from override rollout.group_size"):
        parse_job_config({}, env={}, overrides=["rollout.group_size=many"])


def test_config_show_applies_overrides_even_after_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("trainer: {total_steps: 3}\n")
    assert main(["config", "show", str(job), "trainer.total_steps=9"]) == 0
    assert "total_steps: 9" in capsys.readouterr().out
    config = load_job_config(job, env={}, overrides=["trainer.total_steps=4"])
    assert config.trainer.total_steps == 4


def test_config_check_refuses_a_wrong_key_with_the_field_it_meant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("{}\n")
    assert main(["config", "check", str(job), "trainer.lr=1e-6"]) == 2
    assert "did you mean 'trainer.optimizer.lr'?" in capsys.readouterr().err
