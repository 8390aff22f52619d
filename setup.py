"""Package discovery for kuberl's layout (metadata lives in pyproject.toml).

`services/<name>/` is one deployable, importable as `kuberl.<name>`; `services/weight-sync/` has a
dash on disk and is `kuberl.weight_sync`; the generated contracts under `protos/kuberl/` are
`kuberl.api`. setuptools cannot express these roots declaratively, so the package list is walked here.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
ROOTS = {
    "kuberl": ROOT / "services",
    "kuberl.api": ROOT / "protos" / "kuberl",
}


def _walk(prefix: str, path: Path) -> list[str]:
    found = [prefix]
    for child in sorted(path.iterdir()):
        if child.is_dir() and (child / "__init__.py").exists():
            name = child.name.replace("-", "_")
            found += _walk(f"{prefix}.{name}", child)
    return found


packages: list[str] = []
for prefix, path in ROOTS.items():
    packages += _walk(prefix, path)

setup(
    packages=packages,
    package_dir={
        "kuberl": "services",
        "kuberl.weight_sync": "services/weight-sync",
        "kuberl.api": "protos/kuberl",
    },
)
