"""`kuberl run` end to end: the demo job, shortened, with every service a real process.

One run of examples/demo.yaml cut down to a 5-step warm start and 3 GRPO steps (small groups, a
few eval prompts) must finish with every service having reported SERVING, every rollout replica
having loaded a newer policy, nothing lost or duplicated, every trained group within
`max_staleness`, and a complete run folder. A second run is interrupted with SIGINT after its
first RL step: it must stop everything it started, lose no prompt and say so in its summary.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import REPO, short_demo_job

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SERVICES = {"warm-start", "buffer", "reward", "weight-sync", "rollout-0", "rollout-1", "trainer"}


def _short_job(tmp: Path, *, warm_start: bool) -> Path:
    """examples/demo.yaml with a few steps and prompts (the demo's model, data and services)."""
    return short_demo_job(
        tmp,
        "demo-e2e",
        total_steps=3,
        checkpoint_every=3,
        sft_steps=5 if warm_start else 0,
        sft_batch_size=16,
    )


def _kuberl_run(job: Path, run_dir: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kuberl.cli", "run", str(job), "--run-dir", str(run_dir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
    )


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain text (a run folder's path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("local-run")
    run_dir = tmp / "run"
    # A Redis password in the caller's environment is for some other Redis: the embedded one
    # has none (every service's AUTH once failed on it, and the run with them).
    proc = _kuberl_run(
        _short_job(tmp, warm_start=True), run_dir, REDIS_PASSWORD="not-for-the-embedded-redis"
    )
    output, _ = proc.communicate(timeout=600)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    rows = (
        [
            json.loads(line)
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()
        ]
        if (run_dir / "metrics.jsonl").exists()
        else []
    )
    return {
        "code": proc.returncode,
        "output": output,
        "dir": run_dir,
        "summary": summary,
        "rows": rows,
    }


@pytest.mark.slow
def test_the_short_demo_completes_and_exits_zero(finished_run: dict[str, Any]) -> None:
    assert (finished_run["code"], finished_run["summary"].get("status")) == (0, "completed"), (
        finished_run["output"][-4000:]
    )


@pytest.mark.slow
def test_a_second_run_into_a_used_run_folder_is_refused_and_changes_nothing(
    finished_run: dict[str, Any],
) -> None:
    # It once resumed the first run's checkpoint, replayed its Redis and counted its metrics,
    # and "completed" without training anything.
    run_dir: Path = finished_run["dir"]
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    job = run_dir.parent / "job.yaml"
    proc = _kuberl_run(job, run_dir)
    output, _ = proc.communicate(timeout=120)
    after = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    assert proc.returncode != 0 and f"--run-dir {run_dir} is not empty" in output, output
    assert "Traceback" not in output and after == before


@pytest.mark.slow
def test_every_service_reached_serving(finished_run: dict[str, Any]) -> None:
    services = finished_run["summary"]["services"]
    assert {n for n, s in services.items() if s["reached_serving"]} == SERVICES


@pytest.mark.slow
def test_the_policy_version_advanced_on_every_rollout_replica(
    finished_run: dict[str, Any],
) -> None:
    replicas = finished_run["summary"]["replicas"]
    versions = {name: (r or {}).get("policy_version", 0) for name, r in replicas.items()}
    assert set(versions) == {"rollout-0", "rollout-1"} and min(versions.values()) >= 1, versions


@pytest.mark.slow
def test_no_prompt_was_lost_and_no_group_duplicated(finished_run: dict[str, Any]) -> None:
    s = finished_run["summary"]
    assert (s["prompts_lost"], s["groups_duplicated"], s["groups_trained_twice"]) == (0, 0, 0)


@pytest.mark.slow
def test_the_summary_holds_the_required_figures(finished_run: dict[str, Any]) -> None:
    s = finished_run["summary"]
    # 3 steps of 4 groups of 4; every train prompt leased at least once; two eval rounds
    assert {
        "steps": s["steps"],
        "trajectories_trained": s["trajectories_trained"],
        "prompts_leased>=12": s["prompts_leased"] >= 12,
        "0<wall_seconds<600": 0 < s["wall_seconds"] < 600,
        "eval_accuracy_start in [0, 1]": _fraction(s["eval_accuracy_start"]),
        "eval_accuracy_end in [0, 1]": _fraction(s["eval_accuracy_end"]),
        "prompts_lost": s["prompts_lost"],
        "groups_duplicated": s["groups_duplicated"],
    } == {
        "steps": 3,
        "trajectories_trained": 48,
        "prompts_leased>=12": True,
        "0<wall_seconds<600": True,
        "eval_accuracy_start in [0, 1]": True,
        "eval_accuracy_end in [0, 1]": True,
        "prompts_lost": 0,
        "groups_duplicated": 0,
    }


def _fraction(value: object) -> bool:
    return isinstance(value, float) and 0.0 <= value <= 1.0


# One plain progress line with every live figure (kuberl.local.progress.Progress.line).
PLAIN_LINE = re.compile(
    r"^\[\S+\] RL \| step 3/3 eta \S+ \| reward \S+ acc \S+ \| eval \S+ \| "
    r"tok/s gen \S+ train \S+ \| buffer \S+ stale \S+ \| rollout-0=v\S+ rollout-1=v\S+ \| "
    r"sync \S+ms$",
    re.MULTILINE,
)


@pytest.mark.slow
def test_progress_is_plain_lines_when_stdout_is_not_a_terminal(
    finished_run: dict[str, Any],
) -> None:
    assert PLAIN_LINE.search(finished_run["output"]), finished_run["output"][-3000:]


@pytest.mark.slow
def test_every_trained_group_is_within_max_staleness(finished_run: dict[str, Any]) -> None:
    steps = [r for r in finished_run["rows"] if r["kind"] == "rl"]
    staleness = [r["batch/staleness_max"] for r in steps]
    assert len(steps) == 3 and max(staleness) <= finished_run["summary"]["max_staleness"]


@pytest.mark.slow
def test_the_job_evaluated_after_the_warm_start_and_at_the_end(
    finished_run: dict[str, Any],
) -> None:
    rounds = finished_run["summary"]["eval_rounds"]
    assert [(r["step"], r["groups"]) for r in rounds] == [(0, 8), (3, 8)]


@pytest.mark.slow
def test_the_run_folder_holds_logs_metrics_checkpoints_and_plots(
    finished_run: dict[str, Any],
) -> None:
    run_dir: Path = finished_run["dir"]
    expected = [
        "job.yaml",
        "warm-start.yaml",
        "metrics.jsonl",
        "timeline.jsonl",
        "summary.json",
        "checkpoints/latest",
        *(f"logs/{name}.log" for name in SERVICES),
    ]
    missing = [p for p in expected if not (run_dir / p).is_file()]
    plots = ["reward.png", "throughput.png", "staleness.png", "warm_start.png"]
    not_png = [p for p in plots if (run_dir / p).read_bytes()[:8] != PNG_MAGIC]
    assert (missing, not_png) == ([], [])


def _first_rl_step(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and '"kind": "rl"' in metrics.read_text()


@pytest.mark.slow
def test_sigint_while_training_stops_every_process_and_loses_no_prompt(tmp_path: Path) -> None:
    job = _short_job(tmp_path, warm_start=False)
    doc = yaml.safe_load(job.read_text())
    doc["trainer"]["total_steps"] = 1000  # still training when the SIGINT comes
    job.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    proc = _kuberl_run(job, run_dir)
    try:
        deadline = time.monotonic() + 150
        while not _first_rl_step(run_dir) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        alive_before = _processes_mentioning(str(run_dir))
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    # redis, buffer, reward, weight-sync, 2 rollouts and the trainer (one process: no torchrun)
    assert len(alive_before) >= 7, alive_before
    assert (
        proc.returncode,
        summary["status"],
        summary["steps"] >= 1,
        summary["prompts_lost"],
        summary["groups_duplicated"],
        summary["groups_trained_twice"],
        _processes_mentioning(str(run_dir)),
    ) == (130, "interrupted", True, 0, 0, 0, []), output[-3000:]


@pytest.mark.slow
def test_a_service_that_keeps_failing_ends_the_run_with_its_last_log_lines(tmp_path: Path) -> None:
    job = _short_job(tmp_path, warm_start=False)
    doc = yaml.safe_load(job.read_text())
    doc["job"]["local"]["max_restarts"] = 1
    # A causal LM where a reward model belongs: a model folder, so it passes the checks before
    # the start, and the reward service fails loading it at every start.
    from kuberl.common.modelbuild import build_model

    doc["reward"]["reward_model"] = {"path": str(build_model(tmp_path / "not-an-rm"))}
    doc["reward"]["verifiers"] = {"rm": 1.0}
    job.write_text(yaml.safe_dump(doc))
    proc = _kuberl_run(job, tmp_path / "run")
    out, _ = proc.communicate(timeout=300)
    tail = out[out.find("the job cannot go on") :]
    assert (proc.returncode, "reward" in out, "num_labels is 2" in tail) == (1, True, True), out


@pytest.mark.slow
def test_a_run_whose_start_fails_stops_its_starting_services_at_once(tmp_path: Path) -> None:
    # The buffer cannot reach its Redis and gives up after 3 s, while the trainer and the
    # replicas are still starting (waiting for it). They have nothing to drain or save: the run
    # once took 150 s more to end, the trainer's 120 s grace first.
    job = _short_job(tmp_path, warm_start=False)
    doc = yaml.safe_load(job.read_text())
    doc["job"]["local"]["max_restarts"] = 0
    doc["redis"] = {"url": "redis://127.0.0.1:1/0", "connect_timeout_seconds": 3}
    job.write_text(yaml.safe_dump(doc))
    started = time.monotonic()
    proc = _kuberl_run(job, tmp_path / "run")
    out, _ = proc.communicate(timeout=300)
    seconds = time.monotonic() - started
    assert (proc.returncode, "buffer" in out, seconds < 60) == (1, True, True), (seconds, out)


@pytest.mark.slow
def test_a_job_with_mutual_tls_runs_locally(tmp_path: Path) -> None:
    # The services served mutual TLS as the job said, but the supervisor checked their
    # readiness in plaintext: every service "not ready after 300 s".
    from tests.security.certs import authority

    ca = authority(tmp_path / "pki")
    server = ca.issue("services")
    job = _short_job(tmp_path, warm_start=False)
    doc = yaml.safe_load(job.read_text())
    doc["tls"] = {
        "enabled": True,
        "ca_file": str(ca.cert),
        "cert_file": str(server.cert),
        "key_file": str(server.key),
        "require_client_cert": True,
    }
    doc["trainer"]["total_steps"] = 1
    job.write_text(yaml.safe_dump(doc))
    proc = _kuberl_run(job, tmp_path / "run")
    out, _ = proc.communicate(timeout=400)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (proc.returncode, summary["steps"]) == (0, 1), out[-3000:]
