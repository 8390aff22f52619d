"""`kuberl run job.yaml`: the local supervisor's command line (see `kuberl.local.supervisor`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _cmd_run(args: argparse.Namespace) -> int:
    from kuberl.common.config import ConfigError
    from kuberl.common.logs import setup_logging
    from kuberl.local.supervisor import RunOptions, run

    if args.resume and args.config and "=" in args.config:  # an override, not a job file
        args.overrides, args.config = [args.config, *args.overrides], None
    if (args.config is None) == (args.resume is None):
        raise ConfigError("kuberl run: give a job file, or --resume RUN_DIR (not both)")
    if args.resume and args.run_dir:
        raise ConfigError("kuberl run: --resume goes on in its own folder; drop --run-dir")

    # The supervisor's own log lines go to stderr only when asked (the screen shows progress).
    setup_logging("local", level=args.log_level)
    return run(
        RunOptions(
            job_file=Path(args.config) if args.config else None,
            resume=Path(args.resume) if args.resume else None,
            overrides=args.overrides,
            rollout_replicas=args.rollout_replicas,
            trainer_processes=args.trainer_processes,
            device=args.device,
            max_restarts=args.max_restarts,
            run_dir=Path(args.run_dir) if args.run_dir else None,
            plain=True if args.plain else None,
            chaos=args.chaos,
            chaos_seed=args.chaos_seed,
        )
    )


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser(
        "run",
        help="run a whole job on this machine (every service as its own process)",
        description="Start an embedded Redis and every service (`kuberl serve <service>`) on "
        "loopback ports, show live progress, and write a run folder with logs, metrics, "
        "checkpoints, summary.json and plots. Ctrl-C drains and stops everything. "
        "Flags override the job file's `job.local` section.",
    )
    run.add_argument("config", nargs="?", help="job YAML file (not with --resume)")
    run.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="overrides of the job file's fields, after its KUBERL_* variables "
        "(trainer.optimizer.lr=1e-6 trainer.total_steps=20)",
    )
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="go on with a stopped run (runs/<run>): every service restarts from the run's "
        "checkpoint and Redis state, in the same folder, and the run ends as if never stopped",
    )
    run.add_argument(
        "--rollout-replicas", type=_positive, help="rollout processes (job.local.rollout_replicas)"
    )
    run.add_argument(
        "--trainer-processes",
        type=_positive,
        help="trainer processes, under torchrun when more than one (job.local.trainer_processes)",
    )
    run.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="cpu: everything on CPU; cuda: trainer and a torch rollout engine share GPU 0 with "
        "CUDA IPC weight sync (job.local.device)",
    )
    run.add_argument(
        "--max-restarts", type=int, help="restarts of a crashed service (job.local.max_restarts)"
    )
    run.add_argument(
        "--run-dir", help="exact run folder (default: <job.run_dir>/<job>-<timestamp>)"
    )
    run.add_argument(
        "--plain",
        action="store_true",
        help="plain progress lines even on a terminal (the default when stdout is not one)",
    )
    run.add_argument(
        "--log-level", default="warning", help="the supervisor's own log level (stderr)"
    )
    run.add_argument(
        "--chaos",
        choices=("ci", "long"),
        help="fault injection while the job trains: SIGKILL each service kind and Redis on a "
        "seeded plan (ci: 2 kills per kind + Redis once; long: 6 per kind + Redis once), then "
        "write <run>/chaos.json accounting for every prompt (docs/reliability.md)",
    )
    run.add_argument("--chaos-seed", type=int, help="seed of the fault plan (default: job.seed)")
    run.set_defaults(func=_cmd_run)
