"""Container security contexts: each container may set keys over the global `securityContext`
(the SGLang container alone, for an image that needs root), and by default the SGLang container
runs on a read-only root because every place SGLang 0.5.23 writes is on a volume, which is checked
against SGLang's own source (sglang/srt/environ.py and its fixed /tmp and /dev/shm paths)."""

from __future__ import annotations

import ast
import posixpath
import re
from typing import Any

import pytest

from tests.helm.chart import pod_spec, render, sglang_package

_SGLANG = sglang_package()
if _SGLANG is None:
    pytest.skip("sglang not installed (make setup adds it)", allow_module_level=True)
SGLANG_SRT = _SGLANG / "srt"

ROOT = {"runAsUser": 0, "runAsNonRoot": False, "readOnlyRootFilesystem": False}


def _containers(**overrides: Any) -> dict[str, dict[str, Any]]:
    spec = pod_spec(render("defaults", **overrides).get("Deployment", "rollout"))
    return {c["name"]: c for c in spec["containers"]}


def test_the_sglang_container_alone_can_run_as_root_on_a_writable_root() -> None:
    containers = _containers(rollout={"sglang": {"securityContext": ROOT}})
    sglang_context = containers["sglang"]["securityContext"]
    worker_context = containers["rollout"]["securityContext"]
    assert {k: sglang_context[k] for k in ROOT} == ROOT
    # The keys it does not name stay the global ones, and the worker keeps all of them.
    assert (sglang_context["capabilities"], sglang_context["allowPrivilegeEscalation"]) == (
        {"drop": ["ALL"]},
        False,
    )
    assert (worker_context["readOnlyRootFilesystem"], worker_context["runAsNonRoot"]) == (
        True,
        True,
    )


@pytest.mark.parametrize("component", ["buffer", "reward", "weightSync", "trainer", "redis"])
def test_a_component_can_set_false_over_a_true_global_key(component: str) -> None:
    rendered = render(
        "defaults", **{component: {"securityContext": {"readOnlyRootFilesystem": False}}}
    )
    names = {"weightSync": "weight-sync"}
    kind = "StatefulSet" if component in ("trainer", "redis") else "Deployment"
    container = pod_spec(rendered.get(kind, names.get(component, component)))["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is False


def _sglang_cache_layout() -> tuple[str, dict[str, str]]:
    """SGLANG_CACHE_DIR's default and the caches SGLang points under it ({env var: subfolder}),
    read from sglang/srt/environ.py."""
    tree = ast.parse((SGLANG_SRT / "environ.py").read_text())
    default = next(
        node.value.args[0].args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "SGLANG_CACHE_DIR" for t in node.targets)
    )
    function = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name == "third_party_cache_defaults"
    )
    returned = next(n.value for n in ast.walk(function) if isinstance(n, ast.Return))
    assert isinstance(returned, ast.Dict)
    caches = {}
    for key, value in zip(returned.keys, returned.values, strict=True):
        assert isinstance(key, ast.Constant)
        sub = value.args[1].value if isinstance(value, ast.Call) else ""
        caches[key.value] = sub
    return default, caches


def _fixed_top_folders() -> set[str]:
    """The top folders of the absolute paths in SGLang's string literals (/tmp, /dev/shm)."""
    literal = re.compile(r"""["'](/tmp|/dev/shm)/""")
    return {m for path in SGLANG_SRT.rglob("*.py") for m in literal.findall(path.read_text())}


def test_every_place_sglang_writes_is_a_writable_volume_of_its_container() -> None:
    container = _containers()["sglang"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    writable = [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")]
    default, caches = _sglang_cache_layout()
    cache_dir = env.get("SGLANG_CACHE_DIR", default.replace("~", env["HOME"], 1))
    places = {"SGLANG_CACHE_DIR": cache_dir, "HOME": env["HOME"], "TMPDIR": env["TMPDIR"]}
    places |= {name: env.get(name, posixpath.join(cache_dir, sub)) for name, sub in caches.items()}
    places |= {top: top for top in _fixed_top_folders()}
    unwritable = {
        name: path
        for name, path in places.items()
        if not any(path == m or path.startswith(m + "/") for m in writable)
    }
    assert len(caches) >= 4 and {"/tmp", "/dev/shm"} <= places.keys()
    assert unwritable == {}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
