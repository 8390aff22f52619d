"""Tests of the benchmark scripts under benchmarks/ (loaded from their files: not a package)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.support import REPO


def load(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module."""
    key = f"kuberl_benchmark_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module
