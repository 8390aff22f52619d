"""The local supervisor's process management (`kuberl.local.procs`) on small real processes:
readiness through the port file and gRPC health, restarts within a limit on the same port,
failure with the last log lines, clean finish, and stopping whole process groups."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kuberl.common.channels import health_status, sync_channel
from kuberl.local.procs import ProcessGroup, ProcessSpec, ServiceFailed
from tests.support import REPO

DUMMY = [sys.executable, str(REPO / "tests" / "e2e" / "dummy_service.py")]


def _sh(name: str, script: str, **kw: object) -> ProcessSpec:
    return ProcessSpec(name, ["sh", "-c", script], port_file=False, health=False, **kw)  # type: ignore[arg-type]


def _check_until_failure(group: ProcessGroup, limit: float = 60.0) -> ServiceFailed:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            group.check()
        except ServiceFailed as failure:
            return failure
        time.sleep(0.05)
    raise AssertionError("the process never failed")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def group(tmp_path: Path):
    procs = ProcessGroup(tmp_path / "logs")
    yield procs
    procs.stop_all(grace=2.0)


def test_a_service_is_ready_only_once_its_grpc_health_says_serving(group: ProcessGroup) -> None:
    proc = group.start(ProcessSpec("slow", [*DUMMY, "--ready-delay", "1.5"]))
    with sync_channel(proc.address) as channel:
        status = health_status(channel)
    assert (status, proc.reached_serving) == ("SERVING", True)


def test_a_crashing_process_is_restarted_up_to_its_limit_then_fails_with_its_last_log_lines(
    group: ProcessGroup,
) -> None:
    script = 'echo "loading weights"; echo "fatal: weights file is truncated" >&2; exit 3'
    group.start(_sh("crashy", script, max_restarts=2))
    failure = _check_until_failure(group)
    proc = group["crashy"]
    assert (failure.name, proc.starts, proc.exit_codes) == ("crashy", 3, [3, 3, 3])
    assert "exited with code 3" in str(failure)
    assert "fatal: weights file is truncated" in failure.log_tail


def test_a_restarted_service_gets_its_grpc_port_back_and_serves_again(
    group: ProcessGroup, tmp_path: Path
) -> None:
    argv = [*DUMMY, "--crash-at", "serving", "--crash-times", "1"]
    argv += ["--counter", str(tmp_path / "starts")]
    proc = group.start(ProcessSpec("flaky", argv, max_restarts=1, port_env="DUMMY_PORT"))
    first_port = proc.port
    deadline = time.monotonic() + 60
    while proc.restarts == 0 and time.monotonic() < deadline:
        group.check()
        time.sleep(0.05)
    with sync_channel(proc.address) as channel:
        status = health_status(channel)
    assert (proc.restarts, proc.port, status) == (1, first_port, "SERVING")


def test_a_process_that_dies_while_starting_fails_with_its_log_without_waiting_for_timeout(
    group: ProcessGroup,
) -> None:
    spec = ProcessSpec("broken", [*DUMMY, "--crash-at", "start"], start_timeout=600)
    with pytest.raises(ServiceFailed) as err:
        group.start(spec)
    assert "exited with code 3 while starting" in str(err.value)
    assert "cannot open the model folder" in err.value.log_tail


def test_a_start_that_fails_is_retried_within_the_restart_limit(
    group: ProcessGroup, tmp_path: Path
) -> None:
    argv = [*DUMMY, "--crash-at", "start", "--crash-times", "1"]
    argv += ["--counter", str(tmp_path / "starts")]
    proc = group.start(ProcessSpec("second-time-lucky", argv, max_restarts=1))
    assert (proc.starts, proc.reached_serving) == (2, True)


def test_exit_zero_of_a_process_that_exits_when_done_is_a_finish_not_a_crash(
    group: ProcessGroup,
) -> None:
    # Seen by `check` (the process was running when `start` returned): reported once, never
    # restarted.
    proc = group.start(_sh("trainer", "sleep 0.5; exit 0", exits_when_done=True), wait=False)
    reported: list[str] = []
    deadline = time.monotonic() + 30
    while not proc.finished and time.monotonic() < deadline:
        reported += group.check()
        time.sleep(0.05)
    reported += group.check()
    assert (reported, proc.finished, proc.starts) == (["trainer"], True, 1)


def test_exit_zero_while_starting_is_a_finish_too(group: ProcessGroup) -> None:
    # Done before it was ever seen serving (it never writes the port file `start` waits for):
    # `start` records the finish itself, and `check` has nothing left to report.
    spec = ProcessSpec("trainer", ["sh", "-c", "exit 0"], health=False, exits_when_done=True)
    proc = group.start(spec)
    assert (proc.finished, proc.starts, group.check()) == (True, 1, [])


def test_stop_all_ends_the_whole_process_group_children_included(group: ProcessGroup) -> None:
    proc = group.start(_sh("tree", "sleep 300 & sleep 300 & wait"))
    time.sleep(0.3)  # let the shell start its children
    pgid = proc.pid
    assert pgid is not None and _group_alive(pgid)
    group.stop_all(grace=5.0)
    assert not _group_alive(pgid)


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period(
    group: ProcessGroup,
) -> None:
    group.start(_sh("stubborn", 'trap "" TERM; sleep 300 & wait'))
    time.sleep(0.3)
    codes = group.stop_all(grace=0.5)
    assert codes == {"stubborn": -signal.SIGKILL}
