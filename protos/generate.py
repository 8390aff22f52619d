"""Regenerate the Python code of kuberl's gRPC contracts (run by `make protos`).

Compiles every `protos/kuberl/<service>/v1/*.proto` with the pinned grpcio-tools into
`*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` beside the proto, and rewrites the generated
cross-file imports from the proto package path (`kuberl.common.v1`) to the installed Python
package (`kuberl.api.common.v1`). tests/contract/test_protos.py calls `generate(out_dir)` into a
temporary folder and fails if the result differs from what is committed.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
_IMPORT = re.compile(r"^from kuberl\.(\w+)\.v1 import ", re.MULTILINE)


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto under root/kuberl, sorted so output is deterministic."""
    return sorted((root / "kuberl").rglob("*.proto"))


def generate(out_dir: Path, root: Path = PROTO_ROOT) -> list[Path]:
    """Compile all protos under `root` into `out_dir` (same relative layout); return the files."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(p.relative_to(root)) for p in proto_files(root)],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {root}")
        written = []
        for src in sorted(Path(tmp).rglob("*.py*")):
            rel = src.relative_to(tmp)
            dst = out_dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(_IMPORT.sub(r"from kuberl.api.\1.v1 import ", src.read_text()))
            written.append(dst)
    for pkg in {p.parent for p in written}:
        # kuberl/, kuberl/<service>/ and kuberl/<service>/v1/ are packages of kuberl.api.
        for d in (pkg, pkg.parent):
            init = d / "__init__.py"
            if not init.exists():
                init.write_text("")
    return written


def main() -> int:
    out = PROTO_ROOT
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        for f in files:
            rel = f.relative_to(tmp)
            shutil.copyfile(f, out / rel)
            for d in ((out / rel).parent, (out / rel).parent.parent):
                (d / "__init__.py").touch(exist_ok=True)
            print(f"wrote protos/{rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
