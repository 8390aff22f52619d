"""`kuberl run job.yaml`: a whole job on one machine, every service its own process.

`kuberl.local.cli` calls `run`. The supervisor does for a laptop what the Helm chart does for a
cluster, with the same entrypoints (`kuberl serve <service>`, the trainer under torchrun): it
writes the run folder and the resolved `job.yaml`, builds the model once, runs the SFT warm
start when the job asks for one, starts an embedded Redis and every service at once on ports
picked up front, restarts what crashes, injects faults under `--chaos`, stops the services in
dependency order and writes the summary and plots. Each step and the run folder's layout:
docs/local.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import yaml

from kuberl.common import preflight, roles, tls
from kuberl.common.config import (
    ConfigError,
    JobConfig,
    dump_job_config,
    load_job_config,
    parse_job_config,
)
from kuberl.common.files import write_atomic
from kuberl.common.logs import get_logger
from kuberl.common.redis_server import PortReservation
from kuberl.local.procs import (
    ManagedProcess,
    ProcessGroup,
    ProcessSpec,
    ServiceFailed,
    StopRequested,
    tail_lines,
)
from kuberl.local.progress import MetricsTail, Progress, Snapshot, StatsPoller

log = get_logger(__name__)

METRICS_JSONL_ENV = "KUBERL_METRICS_JSONL"  # the trainer appends one JSON row per step here
TRAINED_JSONL_ENV = "KUBERL_TRAINED_JSONL"  # ... and one row per trained batch (group keys) here
# The warm start's checkpoint folder: the RL trainer continues its tracked runs (job.tracking).
TRACKING_WARM_UP_ENV = "KUBERL_TRACKING_WARM_UP"
TICK_SECONDS = 1.0
ROLES_FOLDER = "roles"  # the run's identities: <process>.token and identities.json
# Config section of each non-rollout service (rollout replicas are named rollout-<i>).
SECTIONS = {"buffer": "buffer", "reward": "reward", "weight-sync": "weight_sync"}


class Interrupted(Exception):
    """Ctrl-C or SIGTERM reached the supervisor."""


def shm_folder_name(run_dir: Path) -> str:
    """The run's folder under /dev/shm: named after the run folder and a digest of its full
    path, since two runs whose folders share a name (`a/run`, `b/run`) must not share one: the
    first to finish would remove it under the other's trainer."""
    digest = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:10]
    return f"kuberl-{run_dir.name}-{digest}"


@dataclass
class RunOptions:
    """What `kuberl run` was asked; None keeps the job file's `job.local` value."""

    job_file: Path | None = None
    overrides: list[str] = field(default_factory=list)  # `section.field=value` from the CLI
    job: Any = None  # instead of job_file: a dict of sections or a JobConfig (kuberl.run)
    resume: Path | None = None  # a run folder to go on with (its job.yaml, Redis, checkpoints)
    rollout_replicas: int | None = None
    trainer_processes: int | None = None
    device: str | None = None
    max_restarts: int | None = None
    run_dir: Path | None = None
    plain: bool | None = None
    chaos: str | None = None  # a profile of kuberl.local.chaos.PROFILES
    chaos_seed: int | None = None  # default: job.seed


def _abs(path: str, base: Path) -> str:
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _latest_hf_export(checkpoint_dir: Path, folder: str = "hf") -> Path:
    """The HF folder of the trainer's latest checkpoint (layout in kuberl.trainer.checkpoint):
    `hf`, or a LoRA job's `merged`."""
    pointer = checkpoint_dir / "latest"
    if not pointer.exists():
        raise FileNotFoundError(f"the warm start wrote no checkpoint ({pointer} is missing)")
    hf = checkpoint_dir / pointer.read_text().strip() / folder
    if not (hf / "config.json").exists():
        raise FileNotFoundError(f"the warm start's checkpoint has no HF export ({hf})")
    return hf


def _thread_count(share: float) -> str:
    """Torch threads for a process given its share of the CPUs: OpenMP threads beyond that share
    spin against each other and against the other services, so small machines get 1."""
    return str(max(1, int((os.cpu_count() or 1) * share)))


class Supervisor:
    """One `kuberl run`. `run()` returns the process exit code."""

    def __init__(
        self, options: RunOptions, out: TextIO | None = None, err: TextIO | None = None
    ) -> None:
        self.options = options
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.cwd = Path.cwd()
        self.started = time.monotonic()
        self.started_unix = time.time()
        self._stop = threading.Event()
        self._sigints = 0
        self.group: ProcessGroup | None = None
        self.redis: Any = None
        self.redis_password = ""  # the embedded Redis's, for this run only
        self.redis_restarts = 0
        self.poller = StatsPoller()
        self.progress: Progress | None = None
        self.config: JobConfig | None = None
        self.doc: dict[str, Any] = {}
        self.run_dir = Path()
        self.shm_dir: Path | None = None
        self.replica_names: list[str] = []
        self.endpoints: dict[str, str] = {}
        self.tokens: dict[str, str] = {}  # process name -> its role token (kuberl.common.roles)
        self.identities_file = ""
        self._reserved = PortReservation()  # the services' ports until they serve
        self.failure: ServiceFailed | None = None
        self.error: str | None = None
        self.model_path = ""
        self.warm_start_hf: str | None = None
        self.phase_seconds: dict[str, float] = {}
        self.chaos: Any = None  # kuberl.local.chaos.ChaosMonkey with --chaos
        self.chaos_report: dict[str, Any] | None = None
        #: Every prompt's fate (kuberl.local.accounting), read before Redis stops.
        self.accounting: dict[str, Any] = {}
        self.rl_rows_seen = 0  # RL steps completed as the trainer's rows tell (restarts included)
        self.last_step = 0
        self.made_run_dir = False  # this run created its folder (removed if it never started)
        self.prepared = False

    # ------------------------------------------------------------------ entry

    def run(self) -> int:
        # Only the main thread may take signals (kuberl.run from a thread: stop it otherwise).
        main = threading.current_thread() is threading.main_thread()
        previous = {
            sig: signal.signal(sig, self._on_signal)
            for sig in (signal.SIGINT, signal.SIGTERM)
            if main
        }
        status = "failed"
        try:
            self._prepare()
            self.prepared = True
            if self._warm_start_wanted():
                self._warm_start()
            self._start_services()
            self._watch()
            status = "completed"
        except (Interrupted, StopRequested):
            status = "interrupted"
        except ServiceFailed as failure:
            self.failure = failure
        except ConfigError as exc:  # a refused job or option: its message says it all
            self.error = str(exc)
        except Exception as exc:  # a bug or a bad setup: still stop everything and report
            log.exception("run.error")
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            try:
                self._shutdown(status)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        return self._report_exit(status)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._sigints += 1
        self._stop.set()
        if self._sigints > 1 and self.group is not None:
            # Second Ctrl-C: no more draining.
            for proc in list(self.group.processes.values()):
                proc.signal(signal.SIGKILL)

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise Interrupted()

    # ------------------------------------------------------------------ setup

    def _prepare(self) -> None:
        from kuberl.common.modelbuild import resolve_model

        opts = self.options
        config = self._load_job()
        # Every file, model, dataset and plugin, before anything starts or any folder is made;
        # models and datasets named by hub id are fetched here, once for every service.
        resolved = preflight.check_job(config, self.cwd)
        local = config.job.local.model_dump()
        for key in ("rollout_replicas", "trainer_processes", "device", "max_restarts"):
            value = getattr(opts, key)
            if value is not None:
                local[key] = value
        if opts.chaos is not None:
            from kuberl.local.chaos import PROFILES

            # Every planned kill may hit one process (a rollout fault picks any replica).
            local["max_restarts"] += PROFILES[opts.chaos].kills_per_kind + 1
        # One GPU: the trainer and one colocated engine, unless replicas are asked for beside the
        # device (`--device cuda` overrides a CPU job file, whose replica count was for CPU).
        file_replicas = (
            opts.device is None and "rollout_replicas" in config.job.local.model_fields_set
        )
        if local["device"] == "cuda" and opts.rollout_replicas is None and not file_replicas:
            local["rollout_replicas"] = 1
        doc = config.model_dump(mode="json")
        doc["job"]["local"] = local
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.started_unix))
        name = config.job.name
        if opts.resume is not None:
            self.run_dir = opts.resume.resolve()
            (self.run_dir / "summary.json").unlink(missing_ok=True)  # rewritten at the end
        elif opts.run_dir:
            self.run_dir = opts.run_dir.resolve()
            if self.run_dir.is_dir() and any(self.run_dir.iterdir()):
                # Its checkpoints would be resumed, its Redis AOF replayed and its metrics
                # counted as this run's, so the new run could "complete" without training.
                raise ConfigError(
                    f"--run-dir {self.run_dir} is not empty: a run cannot continue another; "
                    "give a new folder, or empty this one"
                )
            self.run_dir.mkdir(parents=True, exist_ok=True)
        else:
            runs = Path(_abs(config.job.run_dir, self.cwd))
            runs.mkdir(parents=True, exist_ok=True)
            for n in range(1, 1000):  # two runs of one job started in the same second
                self.run_dir = runs / (f"{name}-{stamp}" + (f"-{n}" if n > 1 else ""))
                try:
                    self.run_dir.mkdir()
                    break
                except FileExistsError:
                    continue
        self.made_run_dir = True
        (self.run_dir / "logs").mkdir(exist_ok=True)
        for section in ("train", "eval"):
            for i, ds in enumerate(doc["data"][section]):
                folder = resolved.datasets.get(f"data.{section}[{i}].path")
                if folder is not None:  # a hub id: the services read the fetched snapshot
                    ds["name"] = ds["name"] or Path(ds["path"]).stem
                    ds["path"] = str(folder)
                else:
                    ds["path"] = _abs(ds["path"], self.cwd)
        if resolved.model is not None:
            doc["model"]["path"] = str(resolved.model.resolve())
            doc["model"]["revision"] = None
        if resolved.reward_model is not None:
            doc["reward"]["reward_model"].update(path=str(resolved.reward_model), revision=None)
        if doc["trainer"]["sft_data"]:
            doc["trainer"]["sft_data"] = _abs(doc["trainer"]["sft_data"], self.cwd)
        for section in ("buffer", "reward", "rollout", "trainer", "weight_sync"):
            doc[section]["server"].update(host="127.0.0.1", port=0, metrics_port=0)
        doc["trainer"]["checkpoint_dir"] = str(self.run_dir / "checkpoints")
        doc["weight_sync"]["snapshot_dir"] = str(self.run_dir / "weights")
        doc["weight_sync"]["advertise_host"] = "127.0.0.1"
        if Path("/dev/shm").is_dir():
            self.shm_dir = Path("/dev/shm") / shm_folder_name(self.run_dir)
            # A run folder given again (--run-dir) after a run that was killed still has that
            # run's versions here, which weight-sync would restore as this job's current version.
            shutil.rmtree(self.shm_dir, ignore_errors=True)
            doc["weight_sync"]["shm_dir"] = str(self.shm_dir)
        if local["device"] == "cuda":
            if doc["rollout"]["engine"]["kind"] == "torch":
                doc["rollout"]["engine"]["device"] = "cuda:0"
            transports = [t for t in doc["weight_sync"]["transports"] if t != "cuda_ipc"]
            doc["weight_sync"]["transports"] = ["cuda_ipc", *transports]
        self.config = parse_job_config(doc, env={}, source=str(opts.job_file or "<job>"))
        # The supervisor's own channels (readiness, stats, the final report) speak the job's TLS:
        # the services' servers accept nothing else.
        tls.configure(self.config.tls)
        self.doc = self.config.model_dump(mode="json")
        self.progress = Progress(
            f"kuberl run {name} -> {self._rel(self.run_dir)}",
            max_staleness=self.config.trainer.max_staleness,
            plain=opts.plain,
            out=self.out,
        )
        self.progress.message(f"kuberl run: {name}, run folder {self._rel(self.run_dir)}")
        self.group = ProcessGroup(self.run_dir / "logs", should_stop=self._stop.is_set)
        started = time.monotonic()
        self.model_path = str(resolve_model(self.config, base_dir=self.cwd).resolve())
        self.phase_seconds["model"] = time.monotonic() - started
        self.doc["model"]["path"] = self.model_path
        self._write_job(self.doc)

    def _load_job(self) -> JobConfig:
        """The job: a file, an object (`kuberl.run`), or the resolved job.yaml of the run folder
        to resume, whose Redis is its embedded one again (started from its AOF) and whose
        endpoints are picked again."""
        opts = self.options
        if opts.resume is not None:
            saved = opts.resume / "job.yaml"
            try:
                doc = yaml.safe_load(saved.read_text())
            except OSError:
                raise ConfigError(
                    f"--resume {opts.resume}: no job.yaml there; give a run folder of "
                    "`kuberl run` (runs/<job>-<time>)"
                ) from None
            if (opts.resume / "redis").is_dir():
                doc["redis"]["url"] = None
            doc.pop("endpoints", None)
            return parse_job_config(doc, source=str(saved), overrides=opts.overrides)
        if opts.job is not None:
            job = opts.job
            doc = job.model_dump(mode="json") if isinstance(job, JobConfig) else job
            return parse_job_config(doc, source="<kuberl.run job>", overrides=opts.overrides)
        return load_job_config(opts.job_file, overrides=opts.overrides)

    def _rel(self, path: Path) -> str:
        with contextlib.suppress(ValueError):
            return str(path.relative_to(self.cwd))
        return str(path)

    def _write_job(self, doc: dict[str, Any], name: str = "job.yaml") -> Path:
        config = parse_job_config(doc, env={}, source=name)  # every value we set is checked
        path = self.run_dir / name
        write_atomic(  # services and watchers read it while the job starts
            path,
            "# Written by `kuberl run`: the job as the services read it (see docs/local.md).\n"
            + dump_job_config(config),
        )
        return path

    @property
    def local(self) -> Any:
        assert self.config is not None
        return self.config.job.local

    def _issue_tokens(self, replica_names: list[str]) -> None:
        """Each process's identity for the run (kuberl.common.roles): a token of its own, and
        the servers' identity file. Under `tls.roles` the certificates name them instead."""
        assert self.config is not None
        if self.config.tls.roles or not self.local.roles:
            return
        names = dict(SECTIONS)
        names.update({name: f"rollout/{name}" for name in replica_names})
        names["trainer"] = "trainer"
        folder = self.run_dir / ROLES_FOLDER
        self.tokens = roles.issue_tokens(folder, self.config.job.name, names)
        self.identities_file = str(folder / "identities.json")

    def _base_env(self, threads: str | None = None, process: str = "") -> dict[str, str]:
        """What every process of the run gets; `process` names whose token it carries."""
        env = {f"KUBERL_ENDPOINTS__{k.upper()}": v for k, v in self.endpoints.items()}
        if process in self.tokens:
            env[roles.TOKEN_ENV] = self.tokens[process]
            env[roles.IDENTITIES_ENV] = self.identities_file
        if self.local.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        if threads and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = threads
        return env

    def _serve_argv(self, service: str, job: Path) -> list[str]:
        return [sys.executable, "-m", "kuberl.cli", "serve", service, "--config", str(job)]

    def _trainer_argv(self, job: Path) -> list[str]:
        """The trainer's command: torchrun for a world of several processes; one process runs
        `kuberl serve trainer` itself (a world of one), without torchrun's agent, whose own torch
        import and rendezvous would only delay the first step."""
        if self.local.trainer_processes == 1:
            return self._serve_argv("trainer", job)
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(self.local.trainer_processes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "127.0.0.1:0",
            "-m",
            "kuberl.cli",
            "serve",
            "trainer",
            "--config",
            str(job),
        ]

    def _spec(self, name: str, argv: list[str], env: dict[str, str], **kw: Any) -> ProcessSpec:
        # The caller's KUBERL_<SECTION>__* overrides are already in the resolved job file; the
        # file, not the inherited environment, is what a service must read.
        inherited = tuple(k for k in os.environ if k.startswith("KUBERL_") and "__" in k)
        inherited += (roles.TOKEN_ENV, roles.IDENTITIES_ENV)  # identities are this run's own
        assert self.config is not None
        if self.config.redis.url is None:
            # The embedded Redis has the run's own password (the buffer is given it): one in
            # the caller's environment is meant for another Redis.
            inherited += (self.config.redis.password_env,)
        return ProcessSpec(
            name,
            argv,
            env=env,
            unset=inherited,
            cwd=str(self.cwd),
            max_restarts=self.local.max_restarts,
            start_timeout=self.local.start_timeout_seconds,
            **kw,
        )

    # ------------------------------------------------------------------ warm start

    def _warm_start_wanted(self) -> bool:
        tc = self.config.trainer if self.config else None
        return bool(tc and tc.mode == "rl" and tc.sft_steps > 0 and tc.sft_data)

    def _warm_start_checkpoints(self) -> Path:
        return self.run_dir / "checkpoints" / "warm-start"

    def _warm_start(self) -> None:
        assert self.config is not None and self.group is not None and self.progress is not None
        tc = self.config.trainer
        doc = json.loads(json.dumps(self.doc))
        checkpoints = self._warm_start_checkpoints()
        doc["trainer"].update(
            mode="sft",
            total_steps=tc.sft_steps,
            sft_steps=0,
            publish_weights=False,
            checkpoint_dir=str(checkpoints),
            checkpoint_every=tc.sft_steps,
            keep_checkpoints=1,
            export_hf=True,
            resume=False,
            linger_seconds=0.0,
        )
        doc["trainer"]["optimizer"]["lr"] = self.local.warm_start_lr or tc.optimizer.lr
        # A LoRA warm start exports its adapters merged: RL's fresh adapters go on top of that.
        adapters = doc["model"].get("lora") is not None
        if adapters and self.local.warm_start_lora:
            doc["model"]["lora"]["export_merged"] = True
        elif adapters:
            doc["model"]["lora"] = None
        export = "merged" if doc["model"].get("lora") else "hf"
        job = self._write_job(doc, "warm-start.yaml")
        self.progress.set_phase("warm start (SFT)", tc.sft_steps)
        rows_path = self.run_dir / "warm-start.jsonl"
        env = {**self._base_env(_thread_count(0.5)), METRICS_JSONL_ENV: str(rows_path)}
        started = time.monotonic()
        proc = self.group.start(
            self._spec(
                "warm-start",
                self._trainer_argv(job),
                env,
                exits_when_done=True,
                port_env="KUBERL_TRAINER__SERVER__PORT",
            ),
            wait=False,
        )
        tail = MetricsTail(rows_path)
        self._wait_all([proc])
        while not proc.finished:
            self._check_stop()
            self.group.check()
            self.progress.add_rows(tail.read())
            self._set_services()
            self.progress.render()
            self._stop.wait(TICK_SECONDS / 2)
        self.progress.add_rows(tail.read())
        self.progress.render(force=True)
        self.phase_seconds["warm_start"] = time.monotonic() - started
        hf = _latest_hf_export(checkpoints, export)
        self.warm_start_hf = str(hf)
        self.doc["model"]["path"] = str(hf)
        self.doc["trainer"]["sft_steps"] = 0
        self._write_job(self.doc)
        self.progress.message(
            f"warm start done in {self.phase_seconds['warm_start']:.0f}s: RL starts from {hf}"
        )

    # ------------------------------------------------------------------ services

    def _start_services(self) -> None:
        from kuberl.common.redis_server import EmbeddedRedis

        assert self.config is not None and self.group is not None and self.progress is not None
        started = time.monotonic()
        self.progress.set_phase("starting services", self.config.trainer.total_steps)
        if self.config.redis.url is None:
            # A password of the run's own, so local processes that hold no token cannot go
            # around the services' checks to the job's state; only the buffer is given it.
            self.redis_password = secrets.token_urlsafe(24)
            self.redis = EmbeddedRedis(
                self.run_dir / "redis", password=self.redis_password, die_with_parent=True
            )
            self.redis.start()
            self.doc["redis"]["url"] = self.redis.address
        # Every gRPC port is picked now, so every address is known before anything starts and
        # all services start at once: each waits for its own dependencies to report SERVING
        # (rollout for buffer, reward and weight-sync; the trainer for the buffer),
        # which overlaps the seconds each spends importing torch and loading the model.
        # Held until every service serves, so no other process can take one in between.
        ports = {name: self._reserved.take() for name in SECTIONS}
        for name, section in SECTIONS.items():
            self.endpoints[section] = f"127.0.0.1:{ports[name]}"
        job = self._write_job(self.doc)
        replica_names = [f"rollout-{i}" for i in range(self.local.rollout_replicas)]
        self._issue_tokens(replica_names)
        first = []
        for name, section in SECTIONS.items():
            port_env = f"KUBERL_{section.upper()}__SERVER__PORT"
            env = {**self._base_env("1", name), port_env: str(ports[name])}
            if section == "buffer" and self.redis_password:
                env[self.config.redis.password_env] = self.redis_password
            spec = self._spec(name, self._serve_argv(section, job), env, port_env=port_env)
            self._check_env(spec)
            first.append(self.group.start(spec, wait=False))
        # Rollout replicas: each with its own ports (announced to weight-sync), id and seed.
        replicas = []
        share = 0.25 / self.local.rollout_replicas
        for i, name in enumerate(replica_names):
            env = {
                **self._base_env(_thread_count(share), name),
                "KUBERL_ROLLOUT__REPLICA_ID": name,
                "KUBERL_ROLLOUT__SERVER__PORT": str(self._reserved.take()),
                "KUBERL_ROLLOUT__SERVER__METRICS_PORT": str(self._reserved.take()),
            }
            if self.config.rollout.engine.kind == "torch":
                env["KUBERL_ROLLOUT__ENGINE__SEED"] = str(self.config.job.seed * 1000 + i)
            spec = self._spec(name, self._serve_argv("rollout", job), env)
            self._check_env(spec)
            replicas.append(self.group.start(spec, wait=False))
            self.replica_names.append(name)
        # The trainer talks only to buffer and weight-sync, and waits in GetBatch until groups
        # arrive.
        env = {
            **self._base_env(_thread_count(0.25), "trainer"),
            METRICS_JSONL_ENV: str(self.run_dir / "metrics.jsonl"),
            TRAINED_JSONL_ENV: str(self.run_dir / "trained.jsonl"),
        }
        if self.warm_start_hf is not None:
            env[TRACKING_WARM_UP_ENV] = str(self._warm_start_checkpoints())
        spec = self._spec(
            "trainer",
            self._trainer_argv(job),
            env,
            exits_when_done=True,
            port_env="KUBERL_TRAINER__SERVER__PORT",
        )
        self._check_env(spec)
        trainer = self.group.start(spec, wait=False)
        self._wait_all([*first, *replicas, trainer])
        self._reserved.release()
        self.endpoints["trainer"] = trainer.address
        # Record the real endpoints so the CLI works against the running job.
        self.doc["endpoints"].update(self.endpoints)
        self._write_job(self.doc)
        self.phase_seconds["start_services"] = time.monotonic() - started
        self.progress.message(
            "services serving: "
            + ", ".join(
                f"{p.name} {p.address}"
                for p in self.group.processes.values()
                if p.port and not p.finished
            )
        )

    def _check_env(self, spec: ProcessSpec) -> None:
        """Validate the job with this process's overrides before starting it."""
        env = {k: v for k, v in spec.env.items() if k.startswith("KUBERL_") and "__" in k}
        parse_job_config(self.doc, env=env, source=f"{spec.name} environment")

    def _wait_all(self, procs: list[ManagedProcess]) -> None:
        assert self.group is not None
        for proc in procs:
            while True:
                self._check_stop()
                self._set_services()
                if self.progress is not None:
                    self.progress.render()
                try:
                    self.group.wait_ready(proc.name)
                    break
                except StopRequested:
                    raise Interrupted() from None
            self._set_services()

    def _set_services(self) -> None:
        if self.group is None or self.progress is None:
            return
        states = {}
        for name, proc in self.group.processes.items():
            if proc.finished:
                states[name] = "finished"
            elif proc.running() and proc.ready_seconds is not None:
                states[name] = "serving"
            elif proc.running():
                states[name] = "starting"
            else:
                states[name] = "stopped"
        restarts = sum(p.restarts for p in self.group.processes.values())
        self.progress.set_services(states, restarts)

    # ------------------------------------------------------------------ watch

    def _snapshot(self) -> Snapshot:
        assert self.group is not None
        snap = Snapshot(time=time.time())
        procs = self.group.processes
        if "trainer" in procs and procs["trainer"].running():
            snap.trainer = self.poller.trainer(procs["trainer"].address)
        if procs["buffer"].running():
            snap.buffer = self.poller.buffer(procs["buffer"].address)
        for name in self.replica_names:
            snap.replicas[name] = (
                self.poller.replica(procs[name].address) if procs[name].running() else None
            )
        ws = procs["weight-sync"]
        if ws.running():
            snap.weight_sync = self.poller.weight_sync(ws.address)
            snap.sync_seconds = self.poller.sync_seconds(ws.metrics_port)
        return snap

    def _watch(self) -> None:
        assert self.group is not None and self.progress is not None and self.config is not None
        self.progress.set_phase("RL", self.config.trainer.total_steps)
        if self.options.chaos is not None:
            from kuberl.local.chaos import ChaosMonkey, chaos_profile

            seed = self.options.chaos_seed
            self.chaos = ChaosMonkey(
                chaos_profile(self.options.chaos, external_redis=self.redis is None),
                self.config.job.seed if seed is None else seed,
                self.config.trainer.total_steps,
                self.replica_names,
            )
            self.progress.message(
                f"chaos: {len(self.chaos.faults)} faults planned (profile "
                f"{self.options.chaos}, seed {self.chaos.seed})"
            )
        tail = MetricsTail(self.run_dir / "metrics.jsonl")
        started = time.monotonic()
        with (self.run_dir / "timeline.jsonl").open("a") as timeline:
            while True:
                self._check_stop()
                self._check_redis()
                self.group.check()
                rows = tail.read()
                self.progress.add_rows(rows)
                for row in rows:
                    if row.get("kind") == "rl":
                        self.rl_rows_seen += 1
                        self.last_step = int(row.get("step") or 0)
                if self.group["trainer"].finished:
                    break
                if self.chaos is not None:
                    self._chaos_tick()
                self.progress.add_snapshot(self._snapshot())
                timeline.write(json.dumps(self.progress.timeline[-1]) + "\n")
                timeline.flush()
                self._set_services()
                self.progress.render()
                self._stop.wait(TICK_SECONDS)
        self.progress.add_rows(tail.read())
        self.phase_seconds["rl"] = time.monotonic() - started

    def _chaos_tick(self) -> None:
        """Note recoveries, then fire the next fault if it is due (see kuberl.local.chaos)."""
        assert self.group is not None and self.chaos is not None and self.progress is not None
        procs = self.group.processes
        names = [*SECTIONS, *self.replica_names, "trainer"]
        up = {n: procs[n].running() for n in names}
        starts = {n: procs[n].starts for n in names}
        if self.redis is not None:
            up["redis"] = self.redis.running()
            starts["redis"] = self.redis_restarts + 1
        now = time.time()
        self.chaos.check_recovery(starts, up, self.rl_rows_seen, now)
        fault = self.chaos.due(self.last_step, now, all(up.values()))
        if fault is None:
            return
        if fault.kind == "redis":
            if self.redis is None:  # an external Redis is not ours to kill
                fault.target = "redis (external: not killed)"
                self.chaos.fired(fault, None, 0, self.last_step, now)
                return
            pid = self.redis.proc.pid if self.redis.proc else None
            self.chaos.fired(fault, pid, starts["redis"], self.last_step, now)
            self.redis.kill()  # the next tick's _check_redis restarts it (AOF replayed)
        else:
            proc = procs[fault.target]
            self.chaos.fired(fault, proc.pid, proc.starts, self.last_step, now)
            proc.signal(signal.SIGKILL)  # its whole process tree, as an evicted pod
        self.progress.message(
            f"chaos: fault {fault.index + 1}/{len(self.chaos.faults)}: SIGKILL {fault.target} "
            f"at step {self.last_step}"
        )

    def _prompt_accounting(self) -> dict[str, Any]:
        """Every prompt's fate and the staleness the final weights were trained at, from the
        buffer's Redis (still up) and trained.jsonl: for summary.json and chaos.json."""
        from kuberl.local import accounting

        assert self.config is not None
        lineage = accounting.trained_lineage(accounting.read_rows(self.run_dir / "trained.jsonl"))
        report = accounting.staleness_trained(lineage, self.config.trainer.max_staleness)
        try:
            url = self.doc["redis"]["url"]
            password = self.redis_password or os.environ.get(self.config.redis.password_env)
            # A chaos run may have just restarted Redis (its AOF loading); otherwise a Redis
            # that does not answer at once is not coming back for the report.
            wait = 60.0 if self.chaos is not None else 5.0
            buffer = accounting.read_buffer_state(url, self.config.job.name, password, wait)
            report.update(accounting.prompt_accounting(buffer, lineage))
        except Exception as exc:  # still write what is known; the missing keys say it failed
            log.exception("accounting.failed")
            report["accounting_error"] = f"{type(exc).__name__}: {exc}"
        return report

    def _chaos_accounting(self, status: str) -> None:
        """chaos.json: the fault record and every prompt's fate (Redis must still be up)."""
        from kuberl.local import accounting

        record = self.chaos.record()
        lineage = accounting.trained_lineage(accounting.read_rows(self.run_dir / "trained.jsonl"))
        report: dict[str, Any] = {"status": status, **record, **self.accounting}
        timeline = self.progress.timeline if self.progress else []
        versions = accounting.replica_versions(timeline, lineage, self.replica_names)
        report["versions_monotonic"] = {n: v["monotonic"] for n, v in versions.items()}
        report["replica_versions"] = versions
        fired = [f for f in self.chaos.faults if f.fired_unix is not None]
        recovered = [f.recovered_unix for f in fired if f.recovered_unix is not None]
        eval_rows = [
            r
            for r in accounting.read_rows(self.run_dir / "metrics.jsonl")
            if r.get("kind") == "eval"
        ]
        report.update(
            accounting.eval_before_after(
                eval_rows,
                fired[0].fired_unix if fired else None,
                max(recovered) if recovered and len(recovered) == len(fired) else None,
            )
        )
        report["restarts"] = {
            name: proc.restarts
            for name, proc in (self.group.processes.items() if self.group else [])
        }
        report["restarts"]["redis"] = self.redis_restarts
        (self.run_dir / "chaos.json").write_text(json.dumps(report, indent=2) + "\n")
        self.chaos_report = report

    def _check_redis(self) -> None:
        """Restart the embedded Redis if it died (same port and folder: the AOF is replayed)."""
        if self.redis is None or self.redis.running():
            return
        self.redis_restarts += 1
        if self.redis_restarts > self.local.max_restarts:
            raise ServiceFailed(
                "redis", "exited", self.redis.log_path, tail_lines(self.redis.log_path)
            )
        log.warning("redis.restart", restarts=self.redis_restarts)
        self.redis.start()

    # ------------------------------------------------------------------ stop

    def _shutdown(self, status: str) -> None:
        self._reserved.release()
        group = self.group
        final_replicas: dict[str, dict[str, Any] | None] = {}
        final_buffer: dict[str, Any] | None = None
        sync: dict[str, tuple[float, float]] = {}
        try:
            if group is not None and group.processes:
                if self.progress is not None:
                    self._set_services()
                    self.progress.close()
                    label = {"completed": "job done", "interrupted": "interrupted"}
                    print(
                        f"kuberl run: {label.get(status, 'failed')}, stopping the services",
                        file=self.out,
                        flush=True,
                    )
                procs = group.processes
                for name in ("trainer", "warm-start"):
                    if name in procs:
                        procs[name].stop(grace=_grace(procs[name], 120))
                for name in self.replica_names:
                    if procs[name].running():
                        final_replicas[name] = self.poller.replica(procs[name].address)
                    else:
                        final_replicas[name] = None
                drain = (self.config.rollout.drain_seconds if self.config else 30) + 30
                self._stop_together(self.replica_names, drain)
                if "buffer" in procs and procs["buffer"].running():
                    final_buffer = self.poller.buffer(procs["buffer"].address)
                if "weight-sync" in procs and procs["weight-sync"].running():
                    sync = self.poller.sync_seconds(procs["weight-sync"].metrics_port)
                self._stop_together(["weight-sync", "reward"], 30)
                self._stop_together(["buffer"], 30)
                group.stop_all(grace=10)  # anything left
        finally:
            self.poller.close()
            if self.config is not None:
                try:
                    self._check_redis()  # killed at the very end: bring it back to read it
                    self.accounting = self._prompt_accounting()
                    if self.chaos is not None:
                        self._chaos_accounting(status)
                except Exception:
                    log.exception("accounting.report_failed")
            if self.redis is not None:
                self.redis.stop()
            if self.shm_dir is not None:
                shutil.rmtree(self.shm_dir, ignore_errors=True)
        if not self.prepared:
            # Nothing ran: a folder of this run would hold only its failure, and the next run
            # of the job is easier to find without it.
            if self.made_run_dir:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            return
        if self.config is not None:
            self._write_report(status, final_buffer, final_replicas, sync)

    def _stop_together(self, names: list[str], grace: float) -> None:
        """SIGTERM several processes at once, then wait for each (SIGKILL after grace)."""
        assert self.group is not None
        procs = [self.group.processes[n] for n in names if n in self.group.processes]
        for proc in procs:
            if proc.running():
                proc.signal(signal.SIGTERM)
        started = time.monotonic()
        for proc in procs:
            proc.stop(grace=max(0.1, started + _grace(proc, grace) - time.monotonic()))

    # ------------------------------------------------------------------ report

    def _write_report(
        self,
        status: str,
        final_buffer: dict[str, Any] | None,
        final_replicas: dict[str, dict[str, Any] | None],
        sync: dict[str, tuple[float, float]],
    ) -> None:
        from kuberl.local.report import build_summary, read_jsonl, write_plots

        assert self.config is not None
        rl_rows = read_jsonl(self.run_dir / "metrics.jsonl")
        warm_rows = read_jsonl(self.run_dir / "warm-start.jsonl")
        timeline = self.progress.timeline if self.progress else []
        services = {}
        if self.group is not None:
            for name, proc in self.group.processes.items():
                services[name] = {
                    "reached_serving": proc.reached_serving,
                    "starts": proc.starts,
                    "restarts": proc.restarts,
                    "exit_codes": proc.exit_codes,
                    "ready_seconds": (
                        round(proc.ready_seconds, 2) if proc.ready_seconds is not None else None
                    ),
                    "log": self._rel(proc.log_path),
                }
        failure = None
        if self.failure is not None:
            failure = {"service": self.failure.name, "reason": self.failure.reason}
        elif self.error is not None:
            failure = {"service": "supervisor", "reason": self.error}
        plots: list[str] = []
        try:
            plots = [
                self._rel(p)
                for p in write_plots(
                    self.run_dir,
                    rl_rows,
                    warm_rows,
                    timeline,
                    title=self.config.job.name,
                    max_staleness=self.config.trainer.max_staleness,
                )
            ]
        except Exception:  # plots are a convenience; the summary must still be written
            log.exception("report.plots_failed")
        from kuberl.local import accounting

        lineage = accounting.trained_lineage(accounting.read_rows(self.run_dir / "trained.jsonl"))
        twice = sum(n > 1 for n in accounting.trained_counts(lineage).values())
        summary = build_summary(
            job=self.config.job.name,
            status=status,
            wall_seconds=time.monotonic() - self.started,
            group_size=self.config.rollout.group_size,
            max_staleness=self.config.trainer.max_staleness,
            rl_rows=rl_rows,
            warm_rows=warm_rows,
            buffer_final=final_buffer,
            replicas_final=final_replicas,
            sync_seconds=sync,
            services=services,
            timeline=timeline,
            extra={
                "failure": failure,
                "run_dir": str(self.run_dir),
                "started_unix": self.started_unix,
                "phase_seconds": {k: round(v, 1) for k, v in self.phase_seconds.items()},
                "model_path": self.model_path,
                "warm_start_model": self.warm_start_hf,
                "redis_restarts": self.redis_restarts,
                "device": self.local.device,
                "rollout_replicas": self.local.rollout_replicas,
                "trainer_processes": self.local.trainer_processes,
                "plots": plots,
                "groups_trained_twice": twice,
            },
            accounting=self.accounting,
        )
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.summary = summary

    def _report_exit(self, status: str) -> int:
        summary = getattr(self, "summary", None)
        if summary is not None:
            start, end = summary["eval_accuracy_start"], summary["eval_accuracy_end"]
            accuracy = ""
            if start is not None and end is not None:
                accuracy = f", held-out accuracy {start:.3f} -> {end:.3f}"
            print(
                f"kuberl run: {status} in {summary['wall_seconds']:.0f}s, "
                f"{summary['steps']} RL steps{accuracy}; {self._rel(self.run_dir)}/summary.json",
                file=self.out,
                flush=True,
            )
        if self.chaos_report is not None:
            c = self.chaos_report
            print(
                f"kuberl run: chaos: {sum(c['faults_injected'].values())} faults injected "
                f"({', '.join(f'{k} {v}' for k, v in c['faults_injected'].items())}), "
                f"{c['faults_survived']} survived; prompts lost {c.get('prompts_lost')}, groups "
                f"trained twice {c.get('groups_trained_twice')}; "
                f"{self._rel(self.run_dir)}/chaos.json",
                file=self.out,
                flush=True,
            )
        if self.failure is not None:
            restarts = ""
            if self.group is not None and self.failure.name in self.group.processes:
                n = self.group.processes[self.failure.name].restarts
                restarts = f" (after {n} restart{'s' if n != 1 else ''})"
            print(
                f"kuberl run: {self.failure.name} {self.failure.reason}{restarts}; the job cannot "
                f"go on. Last lines of {self._rel(self.failure.log_path)}:\n"
                f"{self.failure.log_tail}",
                file=self.err,
                flush=True,
            )
            return 1
        if self.error is not None:
            print(f"kuberl run: {self.error}", file=self.err, flush=True)
            return 1
        return 130 if status == "interrupted" else 0


#: Seconds a process that never reached SERVING gets to stop: it has nothing to drain or save.
#: `serve()` ends an interrupted start within about 2 s (`STOP_STARTING_SECONDS`); this is the
#: backstop for one that does not.
STARTING_GRACE_SECONDS = 5.0


def _grace(proc: ManagedProcess, grace: float) -> float:
    return grace if proc.reached_serving else min(grace, STARTING_GRACE_SECONDS)


def run(options: RunOptions) -> int:
    """`kuberl run`: run the job, return the exit code."""
    return Supervisor(options).run()
