"""Start one container of a pod the way a container runtime does, for tests/images/pods.py.

`start SPEC` runs in the pod's network namespace (the caller wraps it in `ip netns exec`). It
enters new mount, UTS and PID namespaces, sets the hostname to the pod's name, and forks the
container's first process (PID 1 of its namespace, as in a pod): that process bind-mounts the
image's root filesystem at the pod's root (read-only when the container asks for it), mounts a
fresh /proc, /dev and /sys, the pod's volumes and /etc/hosts on top, then chroots there, changes
to the working directory, becomes the container's user and groups, sets no_new_privs and execs
the container's command with exactly its environment. The launcher stays as its parent: it
forwards termination signals (what the kubelet sends) and exits with the container's status.
`exec SPEC ARGV...` does the last part only, for an exec probe that `nsenter` has already put
into the running container's namespaces. Standard library only: it runs as root on the host.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys

PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWPID = 0x00020000, 0x04000000, 0x20000000
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
LIBC = ctypes.CDLL(None, use_errno=True)


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
    no_new_privs = not spec["allow_privilege_escalation"]
    if no_new_privs and LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.execvpe(argv[0], argv, spec["env"])


def _start(spec: dict) -> int:
    """Fork the container's PID 1 in fresh namespaces; its exit status, as a shell reports it."""
    if LIBC.unshare(CLONE_NEWNS | CLONE_NEWUTS) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    _mount("--make-rprivate", "/")
    socket.sethostname(spec["hostname"])
    # The next child forked is PID 1 of the new namespace: nothing else may fork before it.
    if LIBC.unshare(CLONE_NEWPID) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    child = os.fork()
    if child == 0:
        try:
            _mount_filesystems(spec)
            _become_container(spec, spec["argv"])
        except BaseException as exc:  # the container failed to start: say why, as a runtime does
            print(f"launcher: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(128)
    with open(spec["pid_file"], "w") as f:
        f.write(str(child))
    for signum in FORWARDED:
        signal.signal(signum, lambda received, _frame: os.kill(child, received))
    _, status = os.waitpid(child, 0)
    return (
        os.waitstatus_to_exitcode(status) % 256
        if os.WIFEXITED(status)
        else 128 + os.WTERMSIG(status)
    )


def main() -> None:
    mode, spec_path, *argv = sys.argv[1:]
    with open(spec_path) as f:
        spec = json.load(f)
    if mode == "start":
        sys.exit(_start(spec))
    elif mode == "exec":
        _become_container(spec, argv)
    else:
        raise SystemExit(f"launcher: unknown mode {mode!r} (start or exec)")


if __name__ == "__main__":
    main()
