"""The sandbox's launcher: isolates one code run, executes it, reports what happened.

`kuberl.common.sandbox` starts this file as `python -I -S sandbox_launcher.py` (standard library
only, nothing from the service's environment) in a new session, sends one JSON job on stdin and
reads one JSON report from stdout. Modes: `run` runs one program per test (the reward service's
`code` verifier), `exec` runs a snippet once (the rollout service's `python` tool), `reap` kills
every process of a uid. The launcher stays trusted: it never runs the untrusted code in its own
process and is not dumpable. It isolates with the strongest means available (network and mount
namespaces, a dedicated uid, rlimits, killing whatever a program leaves) and reports what it got
in `isolation`; what holds with and without root: docs/reward.md, "code: tests and the sandbox".
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_NOSUID = 2
MS_NODEV = 4
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38

STDERR_KEEP = 4096
RUNNER = """\
import os as _os, sys as _sys
_report, _write = int(_sys.argv[1]), _os.write
_ns = {"__name__": "solution", "__builtins__": __builtins__}
with open(_sys.argv[2]) as _f:
    exec(compile(_f.read(), "solution.py", "exec"), _ns)
with open(_sys.argv[3]) as _f:
    exec(compile(_f.read(), "test.py", "exec"), _ns)
_write(_report, b"ok")
"""

_libc = ctypes.CDLL(None, use_errno=True)


def _call(name: str, *args: Any) -> None:
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _prctl(option: int, value: int) -> None:
    _call("prctl", option, ctypes.c_ulong(value), 0, 0, 0)


def _mount_tmpfs(target: str, size: int) -> None:
    _call(
        "mount",
        b"tmpfs",
        target.encode(),
        b"tmpfs",
        ctypes.c_ulong(MS_NOSUID | MS_NODEV),
        f"size={size},mode=1777".encode(),
    )


def isolate(job: dict[str, Any]) -> tuple[dict[str, str], str]:
    """Enter new namespaces where allowed; return the isolation report and the base folder."""
    report = {"network": "none", "files": "shared", "uid": "shared"}
    base = job["workdir"]
    if os.geteuid() == 0:
        try:
            _call("unshare", CLONE_NEWNET)
            report["network"] = "namespace"
        except OSError as exc:
            report["network_error"] = str(exc)
        try:
            _call("unshare", CLONE_NEWNS)
            _call("mount", None, b"/", None, ctypes.c_ulong(MS_REC | MS_PRIVATE), None)
            for target in ("/tmp", "/var/tmp", "/dev/shm"):
                if os.path.isdir(target):
                    _mount_tmpfs(target, job["limits"]["tmpfs_bytes"])
            base = "/tmp"
            report["files"] = "private"
        except OSError as exc:
            report["files_error"] = str(exc)
        if job.get("uid") is not None:
            report["uid"] = "dedicated"
    else:
        uid, gid = os.getuid(), os.getgid()
        try:
            _call("unshare", CLONE_NEWUSER | CLONE_NEWNET)
        except OSError as exc:
            report["network_error"] = str(exc)
        else:
            report["network"] = "namespace"
            # Map our uid/gid to themselves, or the namespace could not create files.
            for name, text in (
                ("setgroups", "deny"),
                ("uid_map", f"{uid} {uid} 1"),
                ("gid_map", f"{gid} {gid} 1"),
            ):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
    return report, base


def _uid_task_count(uid: int) -> int:
    """Processes and threads of `uid` (what RLIMIT_NPROC counts)."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1 ").split()[0]) == uid:
            count += int(fields.get("Threads", "1").strip())
    return count


def _live_descendants() -> list[int]:
    """Pids of every non-zombie process below this one (orphans are reparented to us)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields and fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    me, found = os.getpid(), []
    for pid in parents:
        node, seen = pid, 0
        while node in parents and seen < 64:
            node, seen = parents[node], seen + 1
            if node == me:
                found.append(pid)
                break
    return found


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid`: kill(-1) from a child that has become that uid."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            # One kill(-1) reaches every process of the uid at once (the task list is locked
            # meanwhile, so a fork bomb cannot outrun it); it does not report whether any was
            # found, so repeat it a couple of times rather than loop on its result.
            for _ in range(3):
                os.kill(-1, signal.SIGKILL)  # never signals the caller itself
        except (ProcessLookupError, PermissionError):
            pass
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def kill_leftovers(uid: int | None) -> None:
    """Kill everything the last program left running.

    With a dedicated uid one kill(-1) as that uid is enough: without capabilities or setuid
    binaries (no_new_privs) nothing the program starts can change uid. With a shared uid, every
    descendant of this subreaper is killed, repeatedly, until none is left.
    """
    if uid is not None:
        kill_uid(uid)
        return
    for _ in range(200):
        pids = _live_descendants()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)


REAP_SECONDS = 5.0


def reap_zombies() -> None:
    """Wait for every process below this launcher (only once the program itself has been waited
    for, or its exit status would be lost). Everything left has been SIGKILLed, but dies a moment
    later; whatever the launcher did not collect would be handed to the pod's pid 1, which in a
    container is often the service itself, and stay a zombie of the sandbox uid. No child left
    means no descendant left: a dying process hands its children to this subreaper first."""
    deadline = time.monotonic() + REAP_SECONDS
    with contextlib.suppress(ChildProcessError):
        while True:
            if os.waitpid(-1, os.WNOHANG)[0]:
                continue
            if time.monotonic() > deadline:  # a process stuck in the kernel: give up on it
                break
            time.sleep(0.001)


def _limits(job: dict[str, Any], nproc: int) -> Any:
    lim = job["limits"]

    def apply() -> None:  # runs in the child after fork (and after setuid as root)
        cpu = lim["cpu_seconds"]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim["max_file_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim["max_open_files"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    return apply


class Program:
    """One test program: started, fed, read with caps and a deadline, then cleaned up."""

    def __init__(self, argv: list[str], job: dict[str, Any], ctx: dict[str, Any]) -> None:
        self.argv, self.job, self.ctx = argv, job, ctx

    def run(self, stdin: bytes | None, deadline: float, pass_fds: tuple[int, ...] = ()) -> dict:
        lim, uid = self.job["limits"], self.ctx["uid"]
        kwargs: dict[str, Any] = {}
        if uid is not None:
            kwargs = {"user": uid, "group": uid, "extra_groups": []}
        proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=self.ctx["workdir"],
            env=self.ctx["env"],
            start_new_session=True,
            close_fds=True,
            pass_fds=pass_fds,
            preexec_fn=_limits(self.job, self.ctx["nproc"]),
            **kwargs,
        )
        out, err, status = bytearray(), bytearray(), ""
        sel = selectors.DefaultSelector()
        assert proc.stdout is not None and proc.stderr is not None
        sel.register(proc.stdout, selectors.EVENT_READ, "out")
        sel.register(proc.stderr, selectors.EVENT_READ, "err")
        pending = memoryview(stdin or b"")
        if proc.stdin is not None:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE, "in")
        pidfd = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ, "exit")
        exited = False
        # Until the program exits its pidfd stays registered; after that, only the pipes are
        # drained (their other writers have been killed, so EOF comes at once).
        while not status and sel.get_map():
            left = deadline - time.monotonic()
            if exited:
                left = min(left, 0.5)
            if left <= 0:
                status = "" if exited else "timeout"
                break
            events = sel.select(left)
            if not events and exited:
                break
            for key, _ in events:
                if key.data == "exit":
                    sel.unregister(pidfd)
                    exited = True
                    kill_leftovers(uid)  # nothing may outlive its program
                elif key.data == "in":
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]) :]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(key.fileobj)
                        key.fileobj.close()  # type: ignore[union-attr]
                else:
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fileobj)
                    elif key.data == "out":
                        out += data
                        if len(out) > lim["max_output_bytes"]:
                            status = "output_limit"
                    else:
                        err = (err + data)[-STDERR_KEEP:]
        sel.close()
        if not exited:
            kill_leftovers(uid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the shared-uid case has no kill_uid
        # wait4, not proc.wait: the rusage tells a CPU-limit kill from any other SIGKILL.
        _, raw, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(raw)
        os.close(pidfd)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        reap_zombies()
        return {
            "status": status,
            "returncode": proc.returncode,
            "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "stdout": bytes(out),
            "err": err,
        }


def _normalize(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _error_line(err: bytes) -> str:
    lines = [ln for ln in err.decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _cpu_killed(run: dict, cpu_seconds: int) -> bool:
    """Whether RLIMIT_CPU ended the program (SIGXCPU at the soft limit, SIGKILL at the hard)."""
    code = run["returncode"]
    return code == -signal.SIGXCPU or (
        code == -signal.SIGKILL and run["cpu_seconds"] >= cpu_seconds - 0.05
    )


def classify(run: dict, expected: str | None, reported_ok: bool, cpu_seconds: int) -> dict:
    """The outcome of one test from what its program did."""
    status, code, err = run["status"], run["returncode"], run["err"]
    cpu_killed = _cpu_killed(run, cpu_seconds)
    if status == "timeout":
        return {"status": "timeout", "detail": "still running at the wall-clock limit"}
    if cpu_killed and not status:
        return {"status": "timeout", "detail": f"used its {cpu_seconds}s of CPU time"}
    if status == "output_limit":
        return {"status": "output_limit", "detail": "wrote more than max_output_bytes"}
    if b"MemoryError" in err:
        return {"status": "memory", "detail": _error_line(err)}
    if expected is None:  # an assert test
        if reported_ok and code == 0:
            return {"status": "passed", "detail": ""}
        kind = "wrong_answer" if b"AssertionError" in err else "runtime_error"
        return {"status": kind, "detail": _error_line(err) or f"exit status {code}"}
    if code != 0:
        return {"status": "runtime_error", "detail": _error_line(err) or f"exit status {code}"}
    got = run["stdout"].decode("utf-8", "replace")
    if _normalize(got) == _normalize(expected):
        return {"status": "passed", "detail": ""}
    return {"status": "wrong_answer", "detail": f"expected {expected[:60]!r}, got {got[:60]!r}"}


def _prepare(job: dict[str, Any], base: str, shared_tasks: int) -> dict[str, Any]:
    """Create the read-only harness folder and the code's writable working folder."""
    uid = job.get("uid") if os.geteuid() == 0 else None
    os.chmod(base, 0o1777 if base == "/tmp" else 0o711)
    harness, work = os.path.join(base, "harness"), os.path.join(base, "work")
    os.mkdir(harness, 0o755)
    os.mkdir(work, 0o700)
    if uid is not None:
        os.chown(work, uid, uid)
    for name, text in (("solution.py", job["code"]), ("runner.py", RUNNER)):
        with open(os.path.join(harness, name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(harness, name), 0o444)
    # Without a dedicated uid, NPROC counts every process of the shared uid, the service's too.
    nproc = job["limits"]["max_processes"] + (shared_tasks if uid is None else 0)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": work,
        "TMPDIR": work,
    }
    return {"uid": uid, "harness": harness, "workdir": work, "env": env, "nproc": nproc}


def _python(job: dict[str, Any]) -> list[str]:
    return [job["python"], "-I", *(["-S"] if job.get("no_site", True) else [])]


def execute(job: dict[str, Any], ctx: dict[str, Any], started: float) -> dict[str, Any]:
    """Mode `exec`: run the code once as a script, no stdin; what it wrote and how it ended."""
    lim = job["limits"]
    deadline = min(time.monotonic() + lim["wall_seconds"], started + job["deadline_seconds"])
    solution = os.path.join(ctx["harness"], "solution.py")
    run = Program([*_python(job), solution], job, ctx).run(None, deadline)
    status, detail = run["status"] or "exited", ""
    if status == "timeout":
        detail = f"still running after {lim['wall_seconds']:g}s of wall clock"
    elif status == "exited" and _cpu_killed(run, lim["cpu_seconds"]):
        status, detail = "timeout", f"used its {lim['cpu_seconds']}s of CPU time"
    elif status == "output_limit":
        detail = f"wrote more than {lim['max_output_bytes']} bytes"
    return {
        "status": status,
        "returncode": run["returncode"],
        "stdout": run["stdout"][: lim["max_output_bytes"]].decode("utf-8", "replace"),
        "stderr": run["err"].decode("utf-8", "replace"),
        "detail": detail,
    }


def run_tests(job: dict[str, Any], ctx: dict[str, Any], started: float) -> list[dict]:
    """Mode `run`: one program (a fresh interpreter) per test, so one test cannot corrupt
    another's result; a result per test."""
    python = _python(job)
    solution = os.path.join(ctx["harness"], "solution.py")
    deadline_all = started + job["deadline_seconds"]
    results: list[dict] = []
    # Every assert test is written before any program runs: the harness shares the run's tmpfs
    # with the programs, and one that fills it must not leave the later tests unwritable (the
    # whole run would fail). A program could read them all, but it can read its own test anyway.
    paths: dict[int, str] = {}
    for i, test in enumerate(job["tests"]):
        if "assert" in test:
            paths[i] = os.path.join(ctx["harness"], f"test_{i}.py")
            with open(paths[i], "w") as f:
                f.write(test["assert"])
            os.chmod(paths[i], 0o444)
    for i, test in enumerate(job["tests"]):
        now = time.monotonic()
        if now >= deadline_all:
            results.append({"status": "not_run", "detail": "the run's deadline passed"})
            continue
        deadline = min(now + job["limits"]["wall_seconds"], deadline_all)
        if "assert" in test:
            path = paths[i]
            read, write = os.pipe()
            argv = [*python, os.path.join(ctx["harness"], "runner.py"), str(write), solution, path]
            try:
                run = Program(argv, job, ctx).run(None, deadline, pass_fds=(write,))
            finally:
                os.close(write)
            with os.fdopen(read, "rb") as f:
                reported = f.read(16) == b"ok"
            results.append(classify(run, None, reported, job["limits"]["cpu_seconds"]))
        else:
            run = Program([*python, solution], job, ctx).run(test["input"].encode(), deadline)
            results.append(classify(run, test["output"], False, job["limits"]["cpu_seconds"]))
    return results


def _stop_on_sigterm(uid: int | None) -> None:
    """On SIGTERM (the service gives up on this run: a timeout, its caller cancelled), kill and
    reap everything below this subreaper, then exit. Programs run in sessions of their own, so
    nothing else reaches their descendants without a dedicated uid: killing this launcher alone
    would leave them running, reparented to pid 1."""

    def stop(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        kill_leftovers(uid)
        if uid is not None:
            kill_leftovers(None)
        reap_zombies()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def main() -> None:
    started = time.monotonic()
    job = json.loads(sys.stdin.buffer.read())
    if job["mode"] == "reap":
        kill_uid(job["uid"])
        sys.stdout.write(json.dumps({"reaped": job["uid"]}))
        return
    _stop_on_sigterm(job.get("uid"))
    # Counted before a user namespace would show every unmapped process as "nobody".
    shared_tasks = _uid_task_count(os.getuid()) if os.geteuid() != 0 else 0
    isolation, base = isolate(job)
    # After isolate: a non-dumpable process cannot write its own uid_map.
    _prctl(PR_SET_DUMPABLE, 0)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    ctx = _prepare(job, base, shared_tasks)
    if job["mode"] == "exec":
        output = execute(job, ctx, started)
        sys.stdout.write(json.dumps({"isolation": isolation, "output": output}))
        return
    results = run_tests(job, ctx, started)
    sys.stdout.write(json.dumps({"isolation": isolation, "results": results}))


if __name__ == "__main__":
    main()
