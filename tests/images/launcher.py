"""Start one container of a pod the way a container runtime does, for tests/images/pods.py.

`start SPEC` runs inside the pod's network namespace and a private mount namespace (the caller
wraps it in `ip netns exec` and `unshare --mount`): it bind-mounts the image's root filesystem at
the pod's root (read-only when the container asks for it), mounts /proc, /dev and /sys, the pod's
volumes and /etc/hosts on top, then chroots there, changes to the working directory, becomes the
container's user and groups, sets no_new_privs and execs the container's command with exactly its
environment. `exec SPEC ARGV...` does the last part only, for an exec probe that `nsenter` has
already put into the running container's namespaces. Standard library only: it runs as root on
the host before the chroot.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

PR_SET_NO_NEW_PRIVS = 38


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def _mount_filesystems(spec: dict) -> None:
    root = spec["root"]
    _mount("--bind", spec["image_root"], root)
    _mount("-t", "proc", "proc", f"{root}/proc")
    _mount("--rbind", "/dev", f"{root}/dev")
    _mount("--rbind", "-o", "ro", "/sys", f"{root}/sys")
    for volume in spec["mounts"]:
        target = root + volume["target"]
        if volume.get("tmpfs"):
            _mount("-t", "tmpfs", "-o", f"size={volume['tmpfs']},mode=1777", "tmpfs", target)
        else:
            _mount("--bind", volume["source"], target)
            if volume["read_only"]:
                _mount("-o", "remount,bind,ro", target)
    if spec["read_only_root"]:
        _mount("-o", "remount,bind,ro", root)


def _become_container(spec: dict, argv: list[str]) -> None:
    os.chroot(spec["root"])
    os.chdir(spec["working_dir"])
    os.setgroups(spec["groups"])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    if not spec["allow_privilege_escalation"]:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.execvpe(argv[0], argv, spec["env"])


def main() -> None:
    mode, spec_path, *argv = sys.argv[1:]
    with open(spec_path) as f:
        spec = json.load(f)
    if mode == "start":
        _mount_filesystems(spec)
        _become_container(spec, spec["argv"])
    elif mode == "exec":
        _become_container(spec, argv)
    else:
        raise SystemExit(f"launcher: unknown mode {mode!r} (start or exec)")


if __name__ == "__main__":
    main()
