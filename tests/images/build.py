"""`make images`: build kuberl's images with Debian's buildah on a machine that has no Docker
daemon and reaches no container registry (only Debian and PyPI).

The base image the Dockerfiles start from (`PYTHON_IMAGE`, python:3.11-slim-bookworm publicly) is
made here: debootstrap a minbase Debian bookworm with Python 3.11, venv and pip, committed as
`localhost/kuberl-base:bookworm`. On it are built the CPU image (kuberl.Dockerfile), the CPU
variant of the trainer image (trainer.Dockerfile with torch's CPU wheel and CPU labels; the
image-test also runs the torch-engine rollout pod on it) and a small Redis image
(tests/images/redis.Dockerfile, Debian's redis-server), because the official one cannot be pulled.
torch comes from a local wheel directory (`--wheels`, default /opt/wheels) mounted into the build,
as download.pytorch.org is not reachable here. Each image is tagged with a hash of everything its
build reads, so an unchanged image is reused, and older tags of the same image are removed.
Run as root (buildah's vfs storage, chroot isolation).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASE = "localhost/kuberl-base:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# What a python:3.11-slim-bookworm image offers the Dockerfiles: python (3.11), venv and pip,
# CA certificates, and apt sources with bookworm's updates and security fixes.
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "python-is-python3", "ca-certificates")
SOURCES = (
    "deb http://deb.debian.org/debian bookworm main\n"
    "deb http://deb.debian.org/debian bookworm-updates main\n"
    "deb http://deb.debian.org/debian-security bookworm-security main\n"
)
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
# What the kuberl Dockerfiles COPY (their .dockerignore): the build context that the tag hashes.
CONTEXT = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "services", "protos")
RECIPE_LABEL = "io.kuberl.recipe"


def buildah(*args: str, capture: bool = False) -> str:
    command = ["buildah", "--storage-driver", "vfs", *args]
    result = subprocess.run(
        command, check=True, text=True, stdout=subprocess.PIPE if capture else None
    )
    return (result.stdout or "").strip()


def _paths_digest(paths: list[Path]) -> str:
    """A hash of these files' and folders' contents and relative paths (no bytecode)."""
    digest = hashlib.sha256()
    for top in paths:
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in files:
            if "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class ImageSpec:
    """One image to build: its Dockerfile, build arguments and the files its build reads."""

    repository: str
    dockerfile: Path
    build_args: dict[str, str] = field(default_factory=dict)
    context: tuple[str, ...] = CONTEXT
    tag_suffix: str = ""

    def tag(self, base_id: str) -> str:
        digest = hashlib.sha256(base_id.encode())
        digest.update(json.dumps(self.build_args, sort_keys=True).encode())
        read = [self.dockerfile, *(REPO / c for c in self.context)]
        if self.context:
            read.append(REPO / "Dockerfiles" / "constraints.txt")
        digest.update(_paths_digest(read).encode())
        return f"localhost/{self.repository}:{digest.hexdigest()[:16]}{self.tag_suffix}"


TORCH_VERSION = "2.13.0"


def _torch_source(wheels: Path) -> dict[str, str]:
    """torch's CPU build from the local wheel directory when it holds it, else from PyTorch's
    CPU index (the Dockerfiles' own default for a CPU build)."""
    if list(wheels.glob(f"torch-{TORCH_VERSION}+cpu-*.whl")):
        return {
            "TORCH_PIP_ARGS": f"--find-links {wheels}",
            "TORCH_REQUIREMENT": f"torch=={TORCH_VERSION}+cpu",
        }
    return {
        "TORCH_PIP_ARGS": "--index-url https://download.pytorch.org/whl/cpu",
        "TORCH_REQUIREMENT": f"torch=={TORCH_VERSION}",
    }


def specs(wheels: Path) -> dict[str, ImageSpec]:
    """The images `make image-test` runs, keyed by role."""
    torch_local = {"PYTHON_IMAGE": BASE, **_torch_source(wheels)}
    return {
        "kuberl": ImageSpec("kuberl", REPO / "Dockerfiles" / "kuberl.Dockerfile", torch_local),
        "trainer": ImageSpec(
            "kuberl-trainer",
            REPO / "Dockerfiles" / "trainer.Dockerfile",
            {**torch_local, "TORCH_CUDA": "cpu", "NVIDIA_DRIVER_MIN": "none"},
            tag_suffix="-cpu",
        ),
        "redis": ImageSpec(
            "kuberl-redis",
            REPO / "tests" / "images" / "redis.Dockerfile",
            {"BASE_IMAGE": BASE},
            context=(),
        ),
    }


def image_id(ref: str) -> str | None:
    out = subprocess.run(
        [
            "buildah",
            "--storage-driver",
            "vfs",
            "inspect",
            "--type",
            "image",
            "--format",
            "{{.FromImageID}}",
            ref,
        ],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() if out.returncode == 0 else None


def _label(ref: str, name: str) -> str | None:
    out = subprocess.run(
        ["buildah", "--storage-driver", "vfs", "inspect", "--type", "image", ref],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        return None
    labels = json.loads(out.stdout).get("OCIv1", {}).get("config", {}).get("Labels") or {}
    return labels.get(name)


def ensure_base() -> str:
    """The bootstrapped base image's ID (made when missing or when its recipe changed)."""
    recipe = hashlib.sha256(
        json.dumps([DEBIAN_MIRROR, BASE_PACKAGES, SOURCES]).encode()
    ).hexdigest()[:16]
    if _label(BASE, RECIPE_LABEL) == recipe:
        found = image_id(BASE)
        assert found
        return found
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kuberl-base-", dir="/var/tmp") as tmp:
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                "bookworm",
                str(rootfs),
                DEBIAN_MIRROR,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        (rootfs / "etc" / "apt" / "sources.list").write_text(SOURCES)
        shutil.rmtree(rootfs / "var" / "lib" / "apt" / "lists", ignore_errors=True)
        shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        container = buildah("from", "scratch", capture=True)
        try:
            mount = buildah("mount", container, capture=True)
            subprocess.run(["cp", "-a", f"{rootfs}/.", mount], check=True)
            buildah(
                "config",
                "--env",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--env",
                "LANG=C.UTF-8",
                "--cmd",
                "python3",
                "--label",
                f"{RECIPE_LABEL}={recipe}",
                container,
            )
            buildah("commit", "--rm", container, BASE)
        except BaseException:
            subprocess.run(["buildah", "--storage-driver", "vfs", "rm", container], check=False)
            raise
    print(f"images: {BASE} bootstrapped in {time.monotonic() - started:.0f} s", file=sys.stderr)
    found = image_id(BASE)
    assert found
    return found


def build(spec: ImageSpec, base_id: str, wheels: Path) -> str:
    """The image's reference, built unless an image with its content tag exists."""
    ref = spec.tag(base_id)
    if image_id(ref):
        print(f"images: {ref} is up to date", file=sys.stderr)
        return ref
    started = time.monotonic()
    args = ["bud", "--isolation", "chroot", "--layers=false", "-f", str(spec.dockerfile)]
    for name, value in spec.build_args.items():
        args += ["--build-arg", f"{name}={value}"]
    # pip and apt in RUN steps use the host's CA bundle (a proxy's CA, where there is one).
    args += ["-v", f"{HOST_CA}:{HOST_CA}:ro"]
    if wheels.is_dir():
        args += ["-v", f"{wheels}:{wheels}:ro"]
    ignore = spec.dockerfile.parent / (spec.dockerfile.name + ".dockerignore")
    if ignore.exists():
        args += ["--ignorefile", str(ignore)]
    context = REPO if spec.context else spec.dockerfile.parent
    buildah(*args, "-t", ref, str(context))
    print(f"images: {ref} built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return ref


def prune(keep: list[str]) -> None:
    """Remove the image-test's working containers of other images, older tags of these images,
    then every image no tag names (vfs keeps a full copy of each, so stale ones cost
    gigabytes)."""
    from tests.images.pods import CONTAINER_PREFIX

    # buildah lists nothing as `null`.
    containers = json.loads(buildah("containers", "--json", capture=True) or "null") or []
    for container in containers:
        name = container.get("containername", "")
        if name.startswith(CONTAINER_PREFIX) and container.get("imagename") not in keep:
            subprocess.run(["buildah", "--storage-driver", "vfs", "rm", name], check=False)
    listing = buildah("images", "--json", capture=True)
    for image in json.loads(listing or "null") or []:
        for name in image.get("names") or []:
            repository = name.rsplit(":", 1)[0]
            if name not in keep and any(k.rsplit(":", 1)[0] == repository for k in keep):
                subprocess.run(["buildah", "--storage-driver", "vfs", "rmi", name], check=False)
    subprocess.run(["buildah", "--storage-driver", "vfs", "rmi", "--prune"], check=False)


def ensure_images(wheels: Path = Path("/opt/wheels")) -> dict[str, str]:
    """Every image of `specs()`, built or reused: role -> image reference."""
    if os.geteuid() != 0:
        raise SystemExit(
            "make images runs buildah with vfs storage and chroot isolation: run as root"
        )
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed: apt-get install buildah debootstrap")
    base_id = ensure_base()
    refs = {role: build(spec, base_id, wheels) for role, spec in specs(wheels).items()}
    prune([BASE, *refs.values()])
    return refs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--wheels", type=Path, default=Path("/opt/wheels"), help="torch's CPU wheel"
    )
    parsed = parser.parse_args()
    print(json.dumps(ensure_images(parsed.wheels), indent=2))


if __name__ == "__main__":
    main()
