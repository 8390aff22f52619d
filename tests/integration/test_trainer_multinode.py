"""The trainer across two nodes: two torchrun agents (one process each, gloo), as two pods would
run them, rendezvous and take the same ZeRO-2 step as plain torch (the step of
tests/integration/test_trainer_zero.py, compared the same way).

Two launches: the chart's own commands (`multi-node-trainer` value set rendered with the real Helm
engine at two nodes: the master pod's `torchrun --node-rank=0 ...` and the worker pod's
`/bin/sh -c 'exec torchrun --node-rank=$((POD_INDEX + 1)) "$@"'`, static rendezvous at the master
pod, with only the address, port, processes per node and the program swapped for local ones), and
torchrun's c10d rendezvous (`--rdzv-backend c10d --rdzv-endpoint host:port`), for users who
launch the trainer themselves.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kuberl.common.redis_server import free_port
from tests.integration.test_trainer_zero import _plain_torch_step
from tests.support import REPO

STAGE = 2
_DIST_ENV = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def _chart_commands(port: int, program: list[str]) -> list[list[str]]:
    """The master's and the first worker's command lines from the rendered chart, made local."""
    from tests.helm.chart import pod_spec, render

    rendered = render("multi-node-trainer", trainer={"nodes": 2, "gpusPerNode": 1})
    commands = []
    for name in ("trainer", "trainer-worker"):
        container = pod_spec(rendered.get("StatefulSet", name))["containers"][0]
        args = []
        for arg in container["args"]:
            if arg == "-m":
                break  # the program: `-m kuberl.cli serve trainer ...` becomes the test's
            if arg.startswith("--master-addr="):
                arg = "--master-addr=127.0.0.1"
            elif arg.startswith("--master-port="):
                arg = f"--master-port={port}"
            elif arg.startswith("--nproc-per-node="):
                arg = "--nproc-per-node=1"
            args.append(arg)
        command = [c.replace("$$", "$") for c in container["command"]]  # Kubernetes' escape
        commands.append(command + args + program)
    return commands


def _c10d_commands(port: int, program: list[str]) -> list[list[str]]:
    agent = [
        "torchrun",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=kuberl-test",
    ]
    return [agent + program, agent + program]


def _run_agents(commands: list[list[str]], folder: Path) -> tuple[list[int] | None, list[str]]:
    """Run both agents at once, each in its own process group; (exit codes, or None when both
    were still running at the deadline, and each agent's output). An agent that fails ends the
    run at once (its peer would wait for it in a collective)."""
    # The agents get a clean world: a distributed setting in this test process's environment
    # (kuberl's init_distributed writes RANK, MASTER_PORT, ... into a process that trains
    # in-process) must not reach them.
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env["POD_INDEX"] = "0"  # the worker StatefulSet's first pod: node rank 1
    folder.mkdir(parents=True, exist_ok=True)
    logs = [folder / f"agent{i}.log" for i in range(len(commands))]
    procs = []
    for cmd, log in zip(commands, logs, strict=True):
        with log.open("wb") as out:
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # the agent and its workers: killed together
                )
            )
    deadline = time.monotonic() + 240
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    hung = all(p.poll() is None for p in procs)
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # leftover workers too
        p.wait()
    outputs = [
        f"--- agent {i}:\n" + log.read_text(errors="replace")[-3000:] for i, log in enumerate(logs)
    ]
    return (None if hung else [p.returncode for p in procs]), outputs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kuberl.common.modelbuild import build_model

    return build_model(tmp_path_factory.mktemp("multinode") / "model", tokenizer="digits", seed=3)


@pytest.fixture(scope="module")
def reference(model_dir: Path):  # type: ignore[no-untyped-def]
    return _plain_torch_step(model_dir)


@pytest.mark.timeout(600)  # two launches of up to 240 s each
@pytest.mark.parametrize("launch", ["chart_static", "c10d"])
def test_two_nodes_rendezvous_and_take_the_plain_torch_step(  # type: ignore[no-untyped-def]
    launch: str, model_dir: Path, reference, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    program = ["-m", "tests.integration.test_trainer_zero", "--worker"]
    program += [str(tmp_path), str(model_dir), str(STAGE)]
    build = _chart_commands if launch == "chart_static" else _c10d_commands
    codes, outputs = _run_agents(build(free_port(), program), tmp_path / "try1")
    if codes is None:
        # Both agents alive at the deadline: a hang seen in one full parallel run of the suite
        # (the static launch, 240 s) and in 2 of 26 runs of this file after it, cause not found.
        # One more launch on a fresh port; the first one's output is kept in the report.
        print("\n".join(["first launch hung; launching again", *outputs]), file=sys.stderr)
        codes, outputs = _run_agents(build(free_port(), program), tmp_path / "try2")
    assert codes == [0, 0], "\n".join(outputs)

    ref_loss, ref_norm, ref_weights, _ = reference
    result = json.loads((tmp_path / f"stage{STAGE}.json").read_text())
    weights = load_file(str(tmp_path / f"stage{STAGE}.safetensors"))
    worst = max((weights[k] - ref_weights[k]).abs().max().item() for k in weights)
    assert result["world_size"] == 2  # one rank on each "node", each with half the batch
    assert result["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert result["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    assert worst < 1e-5, f"max weight difference {worst}"
