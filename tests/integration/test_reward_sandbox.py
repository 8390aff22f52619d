"""Attacks on the code sandbox through the real reward service (`kuberl serve reward` in a
subprocess): an infinite loop, fork bombs, a memory bomb, a 100 MB file, 10,000 open files,
filling its private /tmp, writing outside its folder, reading the service's environment,
opening network sockets, a huge stdout, killing its parent. Each is contained (nothing of it
survives, nothing outside changes) and reported in the score, and the service keeps answering.

Several attacks print a word that only a contained run can print, and their test expects it
(stdin/stdout tests are judged outside the program): a reward of 1.0 there means "contained".
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kuberl.api.reward.v1 import reward_pb2, reward_pb2_grpc
from kuberl.common.channels import sync_channel
from kuberl.common.sandbox import LAUNCHER, claim_uids, default_python
from tests.integration.test_reward_service import reward_job
from tests.support import ServiceProcess, escape_targets, network_probe

SECRET_NAME = "REWARD_TEST_SECRET"
SECRET = f"s3cr3t-{uuid.uuid4().hex}"
UID_BASE = 61000
SLOTS = 2
MAX_PROCESSES = 16
ROOT = os.geteuid() == 0


class Sandboxed:
    def __init__(self, proc: ServiceProcess, stub: reward_pb2_grpc.RewardServiceStub) -> None:
        self.proc, self.stub = proc, stub

    def run(
        self, program: str, expected: str = "", stdin: str = "", tests: list | None = None
    ) -> reward_pb2.SampleScore:
        """Score `program` with the code verifier on one stdin/stdout test (or on `tests`)."""
        tests = tests if tests is not None else [{"input": stdin, "output": expected}]
        sample = reward_pb2.Sample(
            sample_id="attack",
            response=f"```python\n{program}\n```",
            metadata_json=json.dumps({"tests": tests}),
            verifiers=["code"],
        )
        request = reward_pb2.ScoreRequest(samples=[sample])
        return self.stub.Score(request, timeout=60).scores[0]

    def uids(self) -> set[int]:
        """The uids the service's sandbox slots run as (its `kuberl_reward_sandbox_uid` gauges;
        other reward services on this host hold other uids)."""
        url = f"http://127.0.0.1:{self.proc.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        found = re.findall(r'^kuberl_reward_sandbox_uid\{slot="\d+"\} ([0-9.e+]+)$', text, re.M)
        return {int(float(v)) for v in found}

    def processes(self) -> list[int]:
        """Live processes owned by the sandbox's uids."""
        uids, found = self.uids(), []
        for entry in os.listdir("/proc"):
            try:
                st = os.stat(f"/proc/{entry}")
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if entry.isdigit() and st.st_uid in uids and state != "Z":
                found.append(int(entry))
        return found

    def still_answers(self) -> bool:
        ok = reward_pb2.Sample(sample_id="ok", response="#### 5", answer="#### 5")
        reply = self.stub.Score(reward_pb2.ScoreRequest(samples=[ok]), timeout=30)
        return self.proc.proc.poll() is None and reply.scores[0].reward == 1.0


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandboxed]:
    tmp = tmp_path_factory.mktemp("sandbox")
    job = reward_job(
        tmp,
        timeout_seconds=15,
        sandbox={
            "wall_seconds": 3,
            "cpu_seconds": 1,
            "memory_bytes": 256 * 1024 * 1024,
            "max_processes": MAX_PROCESSES,
            "max_output_bytes": 64 * 1024,
            "max_concurrent": SLOTS,
            "uid_base": UID_BASE,
        },
    )
    env = {SECRET_NAME: SECRET}
    with ServiceProcess.kuberl("reward", job, tmp, env=env) as proc:
        proc.wait_serving(timeout=120)
        with sync_channel(proc.address) as channel:
            yield Sandboxed(proc, reward_pb2_grpc.RewardServiceStub(channel))


def test_an_infinite_loop_is_stopped_and_reported_as_a_timeout(sandbox: Sandboxed) -> None:
    score = sandbox.run("while True:\n    pass")
    assert (score.reward, score.breakdown["code/timeout"], score.error) == (0.0, 1.0, "")
    assert "test 0: timeout" in score.details
    assert sandbox.still_answers()


@pytest.mark.skipif(not ROOT, reason="exact NPROC accounting needs the dedicated sandbox uid")
def test_a_process_can_fork_only_up_to_its_process_limit(sandbox: Sandboxed) -> None:
    # One parent forks sleepers until fork fails, then prints how many it got: with NPROC 16,
    # itself and 15 children. The sleepers must not outlive the run.
    program = (
        "import os, time\n"
        "n = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        print(n)\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
    )
    score = sandbox.run(program, expected=str(MAX_PROCESSES - 1))
    assert (score.reward, score.details) == (1.0, "code: 1/1 passed")
    assert sandbox.processes() == []
    assert sandbox.still_answers()


def test_a_fork_bomb_is_contained_and_leaves_no_process(sandbox: Sandboxed) -> None:
    program = (
        "import os, time\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        time.sleep(0.01)\n"
    )
    score = sandbox.run(program)
    assert (score.reward, score.breakdown["code/timeout"]) == (0.0, 1.0)
    assert sandbox.processes() == []
    assert sandbox.still_answers()


def test_a_memory_bomb_hits_the_address_space_limit(sandbox: Sandboxed) -> None:
    score = sandbox.run("blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))")
    assert (score.reward, score.breakdown["code/memory"], "MemoryError" in score.details) == (
        0.0,
        1.0,
        True,
    )
    assert sandbox.still_answers()


def test_a_100_mb_file_is_cut_off_at_the_file_size_limit(sandbox: Sandboxed) -> None:
    # RLIMIT_FSIZE (max_file_bytes, 8 MiB by default): Python ignores SIGXFSZ, so the write that
    # would pass the limit fails with EFBIG and the program ends with that error.
    program = (
        "with open('big.bin', 'wb') as f:\n"
        "    for _ in range(120):\n"
        "        f.write(b'x' * 2**20)\n"
        "        f.flush()\n"
    )
    score = sandbox.run(program, expected="")
    assert (score.reward, score.breakdown["code/runtime_error"], score.error) == (0.0, 1.0, "")
    assert "File too large" in score.details, score.details
    assert sandbox.processes() == []
    assert sandbox.still_answers()


def test_opening_10k_files_stops_at_the_open_files_limit(sandbox: Sandboxed) -> None:
    # RLIMIT_NOFILE (max_open_files, 64 by default).
    program = "files = [open(f'f{i}', 'w') for i in range(10_000)]\nprint(len(files))"
    score = sandbox.run(program, expected="10000")
    assert (score.reward, score.breakdown["code/runtime_error"], score.error) == (0.0, 1.0, "")
    assert "Too many open files" in score.details, score.details
    assert sandbox.processes() == []
    assert sandbox.still_answers()


@pytest.mark.skipif(not ROOT, reason="the private /tmp needs a mount namespace (root)")
def test_filling_its_private_tmp_fails_inside_and_fills_nothing_outside(
    sandbox: Sandboxed,
) -> None:
    # /tmp of a run is a tmpfs of tmpfs_bytes (64 MiB by default); files of 4 MiB stay below
    # the file size limit, so the tmpfs filling up is what stops the program (ENOSPC).
    prefix = f"kuberl-fill-{uuid.uuid4().hex}-"
    program = (
        "n = 0\n"
        "while True:\n"
        f"    with open(f'/tmp/{prefix}{{n}}', 'wb') as f:\n"
        "        f.write(b'x' * 4 * 2**20)\n"
        "    n += 1\n"
    )
    score = sandbox.run(program, expected="")
    outside = [p for p in os.listdir("/tmp") if p.startswith(prefix)]
    assert (score.reward, score.breakdown["code/runtime_error"], outside) == (0.0, 1.0, [])
    assert "No space left on device" in score.details, score.details
    assert sandbox.processes() == []
    assert sandbox.still_answers()


@pytest.mark.skipif(not ROOT, reason="the private /tmp needs a mount namespace (root)")
def test_a_program_that_fills_its_tmp_still_gets_every_test_judged(sandbox: Sandboxed) -> None:
    # The harness keeps its files (the assert tests) on the same tmpfs: a program that fills it
    # in its first test must not leave the later tests unrunnable.
    program = (
        "import errno\n"
        "try:\n"
        "    n = 0\n"
        "    while True:\n"
        "        with open(f'/tmp/fill-{n}', 'wb') as f:\n"
        "            f.write(b'x' * 4 * 2**20)\n"
        "        n += 1\n"
        "except OSError as exc:\n"
        "    full = exc.errno == errno.ENOSPC\n"
        "def add(a, b):\n"
        "    return a + b\n"
    )
    tests = [{"assert": "assert full"}, {"assert": "assert add(1, 2) == 3"}]
    score = sandbox.run(program, tests=tests)
    assert (score.reward, score.details, score.error) == (1.0, "code: 2/2 passed", "")
    assert sandbox.still_answers()


def test_writing_outside_its_folder_changes_nothing_outside(
    sandbox: Sandboxed, tmp_path: Path
) -> None:
    targets = escape_targets(tmp_path)  # the host's /tmp among them: each run has its own
    program = (
        "ok = 0\n"
        f"for path in {[str(t) for t in targets]!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "    except OSError:\n"
        "        ok += 1\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print('done')\n"
    )
    score = sandbox.run(program, expected="done")
    assert (score.reward, [t for t in targets if t.exists()]) == (1.0, [])
    assert sandbox.still_answers()


def test_the_services_environment_cannot_be_read(sandbox: Sandboxed) -> None:
    program = (
        "import os\n"
        f"name = {SECRET_NAME!r}\n"
        "leaks = [k for k in os.environ if k == name or k.startswith('KUBERL')]\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit() and int(pid) != os.getpid():\n"
        "        try:\n"
        "            if name.encode() in open(f'/proc/{pid}/environ', 'rb').read():\n"
        "                leaks.append(pid)\n"
        "        except OSError:\n"
        "            pass\n"
        "print('LEAK', leaks) if leaks else print('clean')\n"
    )
    score = sandbox.run(program, expected="clean")
    assert (score.reward, score.details) == (1.0, "code: 1/1 passed")
    assert sandbox.still_answers()


def test_network_sockets_reach_nothing(sandbox: Sandboxed) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    program = network_probe(port)
    score = sandbox.run(program, expected="blocked")
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()
    assert (score.reward, score.details) == (1.0, "code: 1/1 passed")
    assert sandbox.still_answers()


def test_a_huge_stdout_is_cut_off_and_reported(sandbox: Sandboxed) -> None:
    score = sandbox.run("while True:\n    print('x' * 10000)")
    assert (score.reward, score.breakdown["code/output_limit"]) == (0.0, 1.0)
    assert sandbox.processes() == []
    assert sandbox.still_answers()


def test_killing_its_parent_and_everything_else_it_sees_fails(sandbox: Sandboxed) -> None:
    program = (
        "import os, signal\n"
        "killed = []\n"
        "for pid in [os.getppid(), 1, *map(int, filter(str.isdigit, os.listdir('/proc')))]:\n"
        "    if pid != os.getpid():\n"
        "        try:\n"
        "            os.kill(pid, signal.SIGKILL)\n"
        "            killed.append(pid)\n"
        "        except OSError:\n"
        "            pass\n"
        "print('killed', killed) if killed else print('alive')\n"
    )
    score = sandbox.run(program, expected="alive")
    assert (score.reward, score.details) == (1.0, "code: 1/1 passed")
    assert sandbox.still_answers()


@pytest.mark.skipif(not ROOT, reason="namespaces and a dedicated uid need root")
def test_the_sandbox_reports_full_isolation_when_run_as_root(sandbox: Sandboxed) -> None:
    url = f"http://127.0.0.1:{sandbox.proc.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    gauges = [
        f'kuberl_reward_sandbox_isolated{{aspect="{a}"}} 1.0' for a in ("network", "files", "uid")
    ]
    assert [g for g in gauges if g not in text] == []
    uids = sandbox.uids()
    assert len(uids) == SLOTS and min(uids) >= UID_BASE


#: The non-root fallback's tests run a launcher as `nobody` (setpriv, from root).
as_nobody = pytest.mark.skipif(
    not ROOT or shutil.which("setpriv") is None, reason="needs root to drop to an unprivileged uid"
)
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def nobody_workdir() -> Path:
    """A fresh working folder the `nobody` launcher may write."""
    workdir = Path(tempfile.mkdtemp(prefix="kuberl-nobody-"))
    os.chown(workdir, 65534, 65534)
    return workdir


def launcher_job(
    program: str,
    tests: list[dict],  # type: ignore[type-arg]
    workdir: Path,
    *,
    uid: int | None,
    max_processes: int = MAX_PROCESSES,
    deadline: float = 20,
) -> dict:  # type: ignore[type-arg]
    """A `run` job for the sandbox launcher itself (the tests that start it directly)."""
    return {
        "mode": "run",
        "uid": uid,
        "python": default_python(dedicated_uid=True),
        "code": program,
        "tests": tests,
        "workdir": str(workdir),
        "deadline_seconds": deadline,
        "limits": {
            "cpu_seconds": 2,
            "memory_bytes": 256 * 2**20,
            "max_processes": max_processes,
            "max_file_bytes": 2**20,
            "max_open_files": 64,
            "wall_seconds": 10,
            "max_output_bytes": 2**16,
            "tmpfs_bytes": 2**24,
        },
    }


@as_nobody
def test_without_root_the_launcher_still_cuts_the_network_and_limits_processes() -> None:
    # The fallback a non-root reward container gets: the launcher itself runs as nobody.
    workdir = nobody_workdir()
    program = (
        "import os, socket, time\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', 1), timeout=1)\n"
        "except OSError as exc:\n"
        "    print(exc.errno)\n"
        "n = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
        "print(n)\n"
    )
    expected = f"{errno.ENETUNREACH}\n{MAX_PROCESSES - 1}"
    job = launcher_job(program, [{"input": "", "output": expected}], workdir, uid=None)
    try:
        done = subprocess.run(
            [*NOBODY, job["python"], "-I", "-S", str(LAUNCHER)],
            input=json.dumps(job).encode(),
            capture_output=True,
            timeout=60,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert done.returncode == 0, done.stderr.decode()
    report = json.loads(done.stdout)
    leftovers = subprocess.run(["pgrep", "-u", "65534"], capture_output=True).stdout
    assert (report["isolation"]["network"], report["results"], leftovers) == (
        "namespace",
        [{"status": "passed", "detail": ""}],
        b"",
    )


@as_nobody
def test_without_root_a_launcher_the_service_gives_up_on_leaves_no_process_behind() -> None:
    # The non-root fallback (shared uid, so no uid-wide kill): a program starts a daemon in a
    # session of its own and hangs; the service then gives up on the run (its caller's deadline).
    # Killing the launcher's process group left the daemon running under pid 1.
    import asyncio

    from kuberl.common.sandbox import stop_launcher

    workdir = nobody_workdir()
    program = (
        "import os, subprocess, time\n"
        "subprocess.Popen(['sleep', '4242'], start_new_session=True)\n"
        "open('started', 'w').close()\n"
        "time.sleep(60)\n"
    )
    job = launcher_job(program, [{"input": "", "output": ""}], workdir, uid=None, deadline=60)

    async def give_up() -> int | None:
        proc = await asyncio.create_subprocess_exec(
            *NOBODY, job["python"], "-I", "-S", str(LAUNCHER),
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
        for _ in range(300):
            if any(workdir.rglob("started")):
                break
            await asyncio.sleep(0.1)
        await stop_launcher(proc)
        return proc.returncode

    try:
        code = asyncio.run(give_up())
        started = any(workdir.rglob("started"))
        leftovers = subprocess.run(["pgrep", "-u", "65534", "-a"], capture_output=True, text=True)
    finally:
        subprocess.run(["pkill", "-9", "-u", "65534"], check=False)
        shutil.rmtree(workdir, ignore_errors=True)
    assert (started, code, leftovers.stdout) == (True, 128 + 15, "")


@pytest.mark.skipif(not ROOT, reason="the dedicated sandbox uid needs root")
def test_the_launcher_reaps_every_process_it_killed_before_it_exits(tmp_path: Path) -> None:
    # In a container our service is pid 1 (or sits under an init that reaps nothing): whatever
    # the launcher leaves behind is reparented there and stays a zombie of the sandbox uid, for
    # later runs of that uid to find. Here the launcher's parent is a child subreaper that reaps
    # only the launcher, and counts the processes handed to it.
    (uid,), locks = claim_uids(UID_BASE + 500, 1, setting="test")
    workdir = tmp_path / "work"
    workdir.mkdir()
    program = (
        "import os, time\n"
        "for _ in range(60):\n"
        "    if os.fork() == 0:\n"
        "        if os.fork() == 0:\n"
        "            os.closerange(0, 3)\n"  # a daemon: its end does not show on the pipes
        "            time.sleep(60)\n"
        "        os._exit(0)\n"
        "print('forked')\n"
    )
    tests = [{"input": "", "output": "forked"}] * 3
    job = launcher_job(program, tests, workdir, uid=uid, max_processes=200, deadline=30)
    parent = (
        "import ctypes, json, os, subprocess, sys, time\n"
        "ctypes.CDLL(None).prctl(36, 1)\n"  # PR_SET_CHILD_SUBREAPER
        "done = subprocess.run(sys.argv[1:], input=sys.stdin.buffer.read(), capture_output=True)\n"
        "time.sleep(0.5)\n"
        "handed = []\n"
        "for entry in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        stat = open(f'/proc/{entry}/stat').read()\n"
        "    except OSError:\n"
        "        continue\n"
        "    if int(stat[stat.rfind(')') + 2 :].split()[1]) == os.getpid():\n"
        "        handed.append(entry)\n"
        "report = done.stdout.decode()\n"
        "print(json.dumps({'rc': done.returncode, 'report': report, 'handed': handed}))\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", parent, job["python"], "-I", "-S", str(LAUNCHER)],
            input=json.dumps(job).encode(),
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout
    finally:
        for fd in locks:
            os.close(fd)
    seen = json.loads(out)
    results = json.loads(seen["report"])["results"]
    assert (seen["rc"], seen["handed"]) == (0, [])
    assert results == [{"status": "passed", "detail": ""}] * 3
