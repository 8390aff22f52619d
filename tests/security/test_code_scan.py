"""What the code may not do, checked by reading it (the `ast` of every module in services/ and
protos/, and the descriptors of every proto).

No pickle: nothing imports pickle or its relatives (dill, cloudpickle, joblib, shelve, marshal),
nothing calls torch.save, torch.load without weights_only=True, numpy.load with
allow_pickle=True, pandas.read_pickle or a YAML loader that builds Python objects, and no
process pool or multiprocessing queue carries Python objects between processes (they pickle).
The only multiprocessing imports are torch's CUDA IPC reduction helpers, whose handles travel as
JSON, and, in `kuberl.common.weights.sglang`, the pickler SGLang's /update_weights_from_tensor
requires: kuberl writes that payload (a CUDA IPC handle and tensor metadata, only globals on
SGLang's unpickler allow-list) for the SGLang server beside a rollout replica and never reads
one. DeepSpeed's own checkpoint files are torch.save pickles; the trainer reads them with
weights_only=True (tests/security/tampered_checkpoint.py proves a hostile one is refused).

Plugins only from the job file: no RPC field can name a `module:function` (the only string
field that names code is reward's `Sample.verifiers`, looked up among the verifiers the job
configured), `load_plugin` and `importlib` are called only where the job's fields are read at
start-up, and no RPC handler reaches them.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO

SCANNED = (REPO / "services", REPO / "protos")
PICKLING_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "dill",
    "cloudpickle",
    "joblib",
    "shelve",
    "marshal",
    "copyreg",
}
PROCESS_MODULES = {"multiprocessing", "torch.multiprocessing"}
#: (file, imported module) -> why it is not pickling.
ALLOWED_IMPORTS = {
    ("services/common/weights/transports/cuda_ipc.py", "torch.multiprocessing.reductions"): (
        "CUDA IPC: reduce_tensor / rebuild_cuda_tensor give and take the raw IPC handles, "
        "which travel base64-encoded in JSON; nothing is pickled"
    ),
    ("services/common/weights/sglang.py", "multiprocessing.reduction"): (
        "SGLang's /update_weights_from_tensor takes only ForkingPickler bytes: written (never "
        "read) for the replica's own SGLang server, naming a CUDA IPC handle and tensor metadata"
    ),
    ("services/common/weights/sglang.py", "torch.multiprocessing.reductions"): (
        "rebuild_cuda_tensor: the function the SGLang payload names, as torch's CUDA reduction does"
    ),
}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _kw_is(call: ast.Call, name: str, value: object) -> bool:
    return any(
        k.arg == name and isinstance(k.value, ast.Constant) and k.value.value == value
        for k in call.keywords
    )


def pickle_findings(source: str, path: str) -> list[Finding]:
    """Every way `source` could pickle or unpickle (see the module docstring)."""
    tree = ast.parse(source, path)
    found: list[Finding] = []

    def imported(module: str, line: int) -> None:
        root = module.split(".")[0]
        if (path, module) in ALLOWED_IMPORTS:
            return
        if root in PICKLING_MODULES:
            found.append(Finding(path, line, f"imports {module}"))
        elif module in PROCESS_MODULES or any(module.startswith(m + ".") for m in PROCESS_MODULES):
            found.append(Finding(path, line, f"imports {module} (pickles what crosses processes)"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                imported(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported(node.module, node.lineno)
            if node.module == "concurrent.futures" and any(
                a.name == "ProcessPoolExecutor" for a in node.names
            ):
                found.append(Finding(path, node.lineno, "ProcessPoolExecutor (pickles)"))
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            last = name.rsplit(".", 1)[-1]
            if name == "torch.save":
                found.append(Finding(path, node.lineno, "torch.save writes a pickle"))
            elif name == "torch.load" and not _kw_is(node, "weights_only", True):
                found.append(Finding(path, node.lineno, "torch.load without weights_only=True"))
            elif name in ("np.load", "numpy.load") and not _kw_is(node, "allow_pickle", False):
                if any(k.arg == "allow_pickle" for k in node.keywords):
                    found.append(Finding(path, node.lineno, f"{name} with allow_pickle"))
            elif last in ("read_pickle", "to_pickle") or name == "ProcessPoolExecutor":
                found.append(Finding(path, node.lineno, f"{name} pickles"))
            elif name in ("yaml.unsafe_load", "yaml.full_load", "yaml.load_all") or (
                name == "yaml.load" and not any(k.arg == "Loader" for k in node.keywords)
            ):
                found.append(Finding(path, node.lineno, f"{name} can build Python objects"))
    return found


def _python_files() -> list[Path]:
    return sorted(p for root in SCANNED for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_nothing_in_services_or_protos_pickles_or_unpickles() -> None:
    findings = [
        str(f)
        for p in _python_files()
        for f in pickle_findings(p.read_text(), str(p.relative_to(REPO)))
    ]
    assert findings == []


@pytest.mark.parametrize(
    ("snippet", "what"),
    [
        ("import pickle", "imports pickle"),
        ("from cloudpickle import dumps", "imports cloudpickle"),
        ("import joblib.numpy_pickle", "imports joblib.numpy_pickle"),
        ("import multiprocessing", "imports multiprocessing"),
        ("from torch.multiprocessing import Queue", "imports torch.multiprocessing"),
        ("from concurrent.futures import ProcessPoolExecutor", "ProcessPoolExecutor"),
        ("import torch\ntorch.save(x, 'f')", "torch.save"),
        ("import torch\ntorch.load('f')", "torch.load without weights_only=True"),
        ("import torch\ntorch.load('f', weights_only=False)", "torch.load without"),
        ("import numpy as np\nnp.load('f', allow_pickle=True)", "allow_pickle"),
        ("import pandas as pd\npd.read_pickle('f')", "read_pickle"),
        ("import yaml\nyaml.load(s)", "yaml.load"),
        ("import yaml\nyaml.unsafe_load(s)", "yaml.unsafe_load"),
    ],
)
def test_the_scan_finds_each_kind_of_pickling(snippet: str, what: str) -> None:
    findings = pickle_findings(snippet, "services/example.py")
    assert [what in f.what for f in findings] == [True]


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch.load('f', weights_only=True)",
        "import numpy as np\nnp.load('f')",
        "import yaml\nyaml.safe_load(s)",
        "import json\njson.loads(s)",
        "from safetensors.torch import load_file\nload_file('f')",
    ],
)
def test_the_scan_lets_safe_formats_through(snippet: str) -> None:
    assert pickle_findings(snippet, "services/example.py") == []


# ---------------------------------------------------------------- plugins

#: RPC fields whose name suggests they could name code, and why each cannot.
CODE_NAMING_FIELDS = {
    "kuberl.reward.v1.Sample.verifiers": (
        "verifier names (optionally name=weight) looked up among the verifiers the job file "
        "configured (built-ins and reward.custom); an unknown name, 'os:system' included, is "
        "INVALID_ARGUMENT and nothing is imported"
    ),
}
CODE_WORDS = re.compile(
    r"function|plugin|module|callable|filter|hook|tool|verifier|entry_?point|import|class|spec"
)
#: Every place that imports code named by a string, with the job-file field it reads.
LOADERS = {
    ("services/common/plugins.py", "load_plugin"): "the loader itself",
    ("services/buffer/server.py", "BufferService.__init__"): "buffer.filters",
    ("services/common/plugins.py", "Registry.resolve"): (
        "trainer.algorithm.advantage / policy_loss (a registered name or module:function)"
    ),
    ("services/reward/verifiers/custom.py", "load"): "reward.custom.<name>.function",
    ("services/rollout/functions.py", "load_rollout_function"): "rollout.rollout_function",
    ("services/rollout/tools.py", "ToolRegistry.__init__"): "rollout.multi_turn.tools",
    ("services/common/preflight.py", "_check_plugins"): (
        "every plugin the job file names, checked before a run starts"
    ),
    ("services/trainer/tracking.py", "backend_module"): (
        "a tracking backend's package, a fixed name per backend of job.tracking"
    ),
    ("services/cli.py", "_cmd_serve"): "kuberl.<service>.server, service from argparse choices",
    ("services/cli.py", "build_parser"): "kuberl.<provider>.cli from a fixed tuple",
    ("services/common/weights/__init__.py", "lazy_exports"): (
        "the package's own submodules, from its fixed export table"
    ),
    ("services/common/weights/__init__.py", "lazy_exports.__getattr__"): (
        "the package's own submodules, from its fixed export table"
    ),
}
LOADING_CALLS = {"load_plugin", "import_module", "__import__"}


def _proto_descriptors() -> list[object]:
    from kuberl.api.buffer.v1 import buffer_pb2
    from kuberl.api.common.v1 import trajectory_pb2
    from kuberl.api.reward.v1 import reward_pb2
    from kuberl.api.rollout.v1 import rollout_pb2
    from kuberl.api.trainer.v1 import trainer_pb2
    from kuberl.api.weight_sync.v1 import weight_sync_pb2

    return [buffer_pb2, trajectory_pb2, reward_pb2, rollout_pb2, trainer_pb2, weight_sync_pb2]


def _string_fields(message: object) -> list[tuple[str, str]]:
    from google.protobuf.descriptor import FieldDescriptor

    out = []
    for fd in message.fields:  # type: ignore[attr-defined]
        if fd.type == FieldDescriptor.TYPE_STRING:
            out.append((fd.full_name, fd.name))
        for nested in [fd.message_type] if fd.message_type else []:
            if nested.GetOptions().map_entry:
                out += [(f"{fd.full_name}.{k}", fd.name) for k in ("key", "value")]
    for nested in message.nested_types:  # type: ignore[attr-defined]
        out += _string_fields(nested)
    return out


def test_no_rpc_field_can_name_code_to_load() -> None:
    fields = [
        full
        for module in _proto_descriptors()
        for message in module.DESCRIPTOR.message_types_by_name.values()  # type: ignore[attr-defined]
        for full, name in _string_fields(message)
        if CODE_WORDS.search(name)
    ]
    assert sorted(fields) == sorted(CODE_NAMING_FIELDS)


def _calls_by_function(path: Path) -> dict[str, set[str]]:
    """Names called in each function (qualified by its class) of a module."""
    out: dict[str, set[str]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                out[name] = {
                    _dotted(c.func).rsplit(".", 1)[-1]
                    for c in ast.walk(child)
                    if isinstance(c, ast.Call)
                }
                visit(child, f"{name}.")

    visit(ast.parse(path.read_text()), "")
    return out


def test_code_is_loaded_by_name_only_where_the_job_file_is_read() -> None:
    sites = {
        (str(p.relative_to(REPO)), fn)
        for p in _python_files()
        for fn, calls in _calls_by_function(p).items()
        if calls & LOADING_CALLS
    }
    assert sites == set(LOADERS)


def test_no_rpc_handler_loads_code() -> None:
    rpc_names = {
        m.name
        for module in _proto_descriptors()
        for service in module.DESCRIPTOR.services_by_name.values()  # type: ignore[attr-defined]
        for m in service.methods
    }
    loaders = LOADING_CALLS | {
        "load_rollout_function",
        "ToolRegistry",
        "pool_functions",
        "check_signature",
    }
    offending = [
        f"{p.relative_to(REPO)}:{fn}"
        for p in _python_files()
        for fn, calls in _calls_by_function(p).items()
        if fn.rsplit(".", 1)[-1] in rpc_names and calls & loaders
    ]
    assert offending == []


@pytest.mark.parametrize("stage", [1])
def test_a_tampered_deepspeed_checkpoint_is_refused_when_the_trainer_resumes(
    tmp_path: Path, stage: int
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tests.security.tampered_checkpoint", str(tmp_path), str(stage)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert (outcome["clean_load"], outcome["payload_ran"]) == (True, False)
    assert outcome["error"].startswith("UnpicklingError: Weights only load failed")
