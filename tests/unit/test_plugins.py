"""The module:function plugin loader and its three kinds of error."""

from __future__ import annotations

import pytest

from kuberl.common.plugins import PluginError, load_plugin

MOD = "tests.unit.plugin_samples"


def test_a_function_is_loaded_and_callable() -> None:
    assert load_plugin(f"{MOD}:one_arg", params=["sample"])({}) == 1.0


def test_a_dotted_attribute_is_followed() -> None:
    assert load_plugin(f"{MOD}:Holder.method", params=["sample"])({}) == 0.5


def test_extra_parameters_with_defaults_are_accepted() -> None:
    assert load_plugin(f"{MOD}:with_default", params=["sample"])({}) == 2.0


def test_a_missing_module_says_so() -> None:
    with pytest.raises(PluginError, match="module 'no_such_module' not found"):
        load_plugin("no_such_module:f")


def test_a_missing_attribute_lists_what_the_module_has() -> None:
    with pytest.raises(PluginError, match=r"has no attribute 'nope' \(it has: .*one_arg"):
        load_plugin(f"{MOD}:nope")


def test_a_wrong_signature_shows_how_kuberl_calls_it() -> None:
    with pytest.raises(
        PluginError,
        match=r"wrong signature two_args\(a, b\); kuberl calls it as two_args\(sample\)",
    ):
        load_plugin(f"{MOD}:two_args", params=["sample"])


def test_a_callable_object_with_a_wrong_signature_is_named_by_its_type() -> None:
    # It has no __name__: the loader once raised AttributeError instead of PluginError.
    with pytest.raises(PluginError, match=r"wrong signature _TwoArgs\(a, b\)"):
        load_plugin(f"{MOD}:TWO_ARG_OBJECT", params=["sample"])


def test_a_non_callable_attribute_is_refused() -> None:
    with pytest.raises(PluginError, match="is a int, not callable"):
        load_plugin(f"{MOD}:NOT_CALLABLE")


@pytest.mark.parametrize("spec", ["no_colon", ":f", "mod:"])
def test_a_malformed_spec_shows_the_expected_form(spec: str) -> None:
    with pytest.raises(PluginError, match="expected 'package.module:function'"):
        load_plugin(spec)


def test_an_error_raised_while_importing_the_plugin_is_reported() -> None:
    with pytest.raises(PluginError, match="raised RuntimeError: this plugin cannot be imported"):
        load_plugin("tests.unit.plugin_broken:f")
