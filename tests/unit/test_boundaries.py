"""Service boundaries: services meet only in `protos/` (`kuberl.api`) and `kuberl.common`.

Every module under services/ is parsed (never imported) and each import is checked against the
rule of the package that makes it:

- a service (`kuberl.buffer`, `rollout`, `reward`, `trainer`, `weight_sync`, `local`) imports its
  own package, `kuberl.common`, `kuberl.api` and the root `kuberl`, nothing of another service.
  `kuberl.local` is a service like the others: its supervisor starts every service as a
  subprocess (`kuberl serve <service>`) and reads their ports, logs and metrics, never their code.
- `kuberl.common`, the runtime every service ships, imports no service at all.
- `kuberl.cli`, the console script that dispatches to every service, may also reach a service's
  entrypoints, `kuberl.<service>.server` and `kuberl.<service>.cli`, and only inside a function:
  `kuberl --help` loads no service, and a command loads only the service it runs.
- the root package `kuberl`, whose `kuberl.run()` is the Python API of `kuberl run`, may reach
  `kuberl.local.api` the same way, inside a function.

An import is `import x`, `from x import y` (relative ones resolved, `y` counted as a possible
submodule), or `importlib.import_module("x")`; the fields of an f-string target read as any name,
so the cli's `f"kuberl.{service}.server"` is checked as `kuberl.*.server`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO

SERVICES = ("buffer", "rollout", "reward", "trainer", "weight_sync", "local")
SHARED = ("common", "api")
CLI = "cli"  # services/cli.py, the console script
ENTRYPOINTS = ("server", "cli")
ANY = "*"  # an f-string field in an import_module target


@dataclass(frozen=True)
class Import:
    target: str  # dotted name, ANY for an f-string field
    line: int
    lazy: bool  # made inside a function


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    importer: str
    target: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.target}"


def module_name(root: Path, path: Path) -> str:
    """services/weight-sync/server.py -> kuberl.weight_sync.server (the installed name)."""
    parts = [p.replace("-", "_") for p in path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kuberl", *parts])


def _import_module_target(node: ast.Call) -> str | None:
    """The module an `import_module(...)` / `__import__(...)` call names, if written in the code
    (a plugin path held in a variable is the user's code, not a kuberl package)."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr):  # f"kuberl.{name}.server": a field may name any package
        return "".join(v.value if isinstance(v, ast.Constant) else ANY for v in arg.values)
    return None


def imports(source: str, module: str, is_package: bool) -> list[Import]:
    """Every kuberl import `module` makes, with its line and whether a function makes it."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(a.name, node.lineno, lazy) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append(Import(base, node.lineno, lazy))
            found.extend(Import(f"{base}.{a.name}", node.lineno, lazy) for a in node.names)
        elif isinstance(node, ast.Call) and (target := _import_module_target(node)):
            found.append(Import(target, node.lineno, lazy))
        inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(source), False)
    return [i for i in found if i.target == "kuberl" or i.target.startswith("kuberl.")]


def owner(name: str) -> str:
    """Which part of kuberl a dotted name belongs to: a service, `common`, `api`, `cli`, or
    `kuberl` (the root package and its attributes, e.g. `kuberl.__version__`)."""
    parts = name.split(".")
    top = parts[1] if len(parts) > 1 else ""
    return top if top in (*SERVICES, *SHARED, CLI, ANY) else "kuberl"


def allowed(importer: str, imp: Import) -> bool:
    """The rule of the module docstring, for one import of a module owned by `importer`."""
    target = owner(imp.target)
    if target in (*SHARED, "kuberl") or target == importer:
        return True
    if importer == CLI and target in (*SERVICES, ANY):
        parts = imp.target.split(".")
        return imp.lazy and len(parts) >= 3 and parts[2] in ENTRYPOINTS
    if importer == "kuberl":
        api = "kuberl.local.api"
        return imp.lazy and (imp.target == api or imp.target.startswith(f"{api}."))
    return False


def violations(root: Path) -> list[Violation]:
    """Every import under `root` (a services/ tree) that crosses a boundary."""
    found: list[Violation] = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(root, path)
        rel = path.relative_to(root.parent).as_posix()
        for imp in imports(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            reported = (v for v in found if v.path == rel and v.line == imp.line)
            if any(imp.target.startswith(f"{v.target}.") for v in reported):
                continue  # `from x import y` where x itself is already reported
            if not allowed(owner(module), imp):
                found.append(Violation(rel, imp.line, module, imp.target))
    return found


def _live(importers: tuple[str, ...]) -> list[str]:
    return [str(v) for v in violations(REPO / "services") if owner(v.importer) in importers]


def test_no_service_imports_another_service() -> None:
    crossing = _live(SERVICES)
    assert not crossing, "imports across a boundary:\n" + "\n".join(crossing)


def test_the_shared_runtime_imports_no_service() -> None:
    crossing = _live(("common",))
    assert not crossing, "imports across a boundary:\n" + "\n".join(crossing)


def test_the_console_script_reaches_services_only_through_their_entrypoints_lazily() -> None:
    crossing = _live((CLI, "kuberl"))
    assert not crossing, "imports across a boundary:\n" + "\n".join(crossing)


def test_every_package_under_services_has_a_boundary_rule() -> None:
    # A new package or top-level module would otherwise fall under the root's rule unchecked.
    root = REPO / "services"
    packages = {p.name.replace("-", "_") for p in root.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in root.glob("*.py")}
    assert (packages - {*SERVICES, *SHARED}, modules - {"__init__", CLI}) == (set(), set())


# The checker itself, on small trees: each case is one module and what it must be told.
CASES = {
    "a service importing another": (
        "rollout/worker.py",
        "from kuberl.buffer.client import encode_put\n",
        ["kuberl.buffer.client"],
    ),
    "a service importing another's package by name": (
        "rollout/worker.py",
        "from kuberl import buffer, common\n",
        ["kuberl.buffer"],
    ),
    "a relative import out of the service": (
        "rollout/engine/base.py",
        "from ... import trainer\n",
        ["kuberl.trainer"],
    ),
    "a lazy import in a service": (
        "trainer/loop.py",
        "def f():\n    import kuberl.weight_sync.store\n",
        ["kuberl.weight_sync.store"],
    ),
    "a computed import in a service": (
        "local/supervisor.py",
        "import importlib\ndef f(s):\n    importlib.import_module(f'kuberl.{s}.server')\n",
        ["kuberl.*.server"],
    ),
    "the shared runtime importing a service": (
        "common/modelbuild.py",
        "def f():\n    from kuberl.buffer.datasets import read_dataset\n",
        ["kuberl.buffer.datasets"],
    ),
    "the console script importing a service at module level": (
        "cli.py",
        "import kuberl.buffer.server\n",
        ["kuberl.buffer.server"],
    ),
    "the console script importing a service's internals": (
        "cli.py",
        "def f():\n    from kuberl.buffer import store\n",
        ["kuberl.buffer"],
    ),
    "the root package importing the supervisor's internals": (
        "__init__.py",
        "def run():\n    from kuberl.local.supervisor import Supervisor\n",
        ["kuberl.local.supervisor"],
    ),
    "the root package importing the Python API at module level": (
        "__init__.py",
        "from kuberl.local.api import run\n",
        ["kuberl.local.api"],
    ),
    "allowed: the root package's lazy Python API": (
        "__init__.py",
        "def run():\n    from kuberl.local.api import run\n",
        [],
    ),
    "allowed: own package, common, api, the root": (
        "weight-sync/server.py",
        "from kuberl import __version__\nfrom kuberl.api.weight_sync.v1 import weight_sync_pb2\n"
        "from kuberl.common.weights import EngineClient\nfrom kuberl.weight_sync import store\n"
        "from . import registry\n",
        [],
    ),
    "allowed: the console script's lazy entrypoints": (
        "cli.py",
        "import importlib\ndef f(s):\n    importlib.import_module(f'kuberl.{s}.server')\n"
        "    from kuberl.local.cli import add_commands\n",
        [],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_the_checker_reports_exactly_the_crossing_imports(tmp_path: Path, case: str) -> None:
    rel, source, expected = CASES[case]
    root = tmp_path / "services"
    path = root / rel
    path.parent.mkdir(parents=True)
    path.write_text(source)
    assert [v.target for v in violations(root)] == expected
