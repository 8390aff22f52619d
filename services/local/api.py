"""The Python API of `kuberl run`: `kuberl.run(job)` in a notebook or a script, as TRL users write
`GRPOTrainer(...).train()`. It runs the same supervisor as the command line and returns the run's
summary (the contents of summary.json) instead of an exit code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kuberl.common.config import ConfigError, JobConfig
from kuberl.local.supervisor import RunOptions, Supervisor


def run(
    job: str | Path | Mapping[str, Any] | JobConfig | None = None,
    *,
    overrides: Sequence[str] = (),
    run_dir: str | Path | None = None,
    resume: str | Path | None = None,
    rollout_replicas: int | None = None,
    trainer_processes: int | None = None,
    device: str | None = None,
    max_restarts: int | None = None,
    plain: bool | None = True,
) -> dict[str, Any]:
    """Run a job on this machine and return its summary (`status`, `steps`, `run_dir`, eval
    accuracy, ...; docs/local.md lists the keys). `job`: a job file, a dict of sections or a
    JobConfig; `overrides`: `section.field=value` strings; `resume`: a run folder to go on with
    instead of a job. A job that cannot start raises ConfigError with every problem; a run
    that started returns its summary whatever its status (completed, interrupted, failed)."""
    options = RunOptions(
        job_file=Path(job) if isinstance(job, str | Path) else None,
        job=None if isinstance(job, str | Path) else job,
        overrides=list(overrides),
        resume=Path(resume) if resume is not None else None,
        run_dir=Path(run_dir) if run_dir is not None else None,
        rollout_replicas=rollout_replicas,
        trainer_processes=trainer_processes,
        device=device,
        max_restarts=max_restarts,
        plain=plain,
    )
    if (job is None) == (resume is None):
        raise ConfigError("kuberl.run: give a job, or resume= a run folder (not both)")
    supervisor = Supervisor(options)
    supervisor.run()
    summary: dict[str, Any] | None = getattr(supervisor, "summary", None)
    if summary is None:
        raise ConfigError(supervisor.error or "kuberl.run: the run wrote no summary")
    return summary
