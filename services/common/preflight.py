"""Everything a job names, checked before anything starts: `kuberl run` calls `check_job` before it
makes a run folder, and `kuberl config check --files` calls it alone. Files must be there and
readable in their format, plugins must import, and models and datasets named by hub id are
fetched into the Hugging Face cache (`kuberl.common.hub`), so the services then find them
locally. Every problem is one line naming the field and the fix, all of them in one ConfigError.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from kuberl.common import hub
from kuberl.common.config import BUILTIN_ADVANTAGES, BUILTIN_POLICY_LOSSES, ConfigError, JobConfig
from kuberl.common.datasets import FILE_SUFFIXES, is_saved_dataset

BUILTIN_TOOLS = ("calculator", "python")


@dataclass
class Resolved:
    """Local folders for what the job named by hub id (fields as dotted paths)."""

    model: Path | None = None
    reward_model: Path | None = None
    datasets: dict[str, Path] = field(default_factory=dict)  # "data.train[0].path" -> folder


def _plugins(config: JobConfig) -> list[tuple[str, str, list[str] | None]]:
    """(field, spec, the arguments the service passes) of every `module:function` the job names;
    the trainer checks its algorithm plugins' calls itself, against its registries."""
    found: list[tuple[str, str, list[str] | None]] = [
        (f"buffer.filters[{i}]", s, ["group"]) for i, s in enumerate(config.buffer.filters)
    ]
    found += [
        (f"reward.custom.{n}.function", v.function, ["sample"])
        for n, v in config.reward.custom.items()
    ]
    found += [
        (f"rollout.multi_turn.tools[{i}]", t, ["arguments"])
        for i, t in enumerate(config.rollout.multi_turn.tools)
        if t not in BUILTIN_TOOLS
    ]
    if config.rollout.rollout_function:
        spec = config.rollout.rollout_function
        found.append(("rollout.rollout_function", spec, ["context", "prompt"]))
    algo = config.trainer.algorithm
    if algo.advantage not in BUILTIN_ADVANTAGES:
        found.append(("trainer.algorithm.advantage", algo.advantage, None))
    if algo.policy_loss not in BUILTIN_POLICY_LOSSES:
        found.append(("trainer.algorithm.policy_loss", algo.policy_loss, None))
    return found


def _check_plugins(config: JobConfig, base: Path) -> list[str]:
    """Import each plugin and check its call as the services will (from the working
    directory)."""
    from kuberl.common.plugins import PluginError, load_plugin

    problems = []
    sys.path.insert(0, str(base))  # services run with the job's directory as cwd
    try:
        for name, spec, params in _plugins(config):
            try:
                load_plugin(spec, kind=name, params=params)
            except PluginError as exc:
                problems.append(str(exc))
    finally:
        sys.path.remove(str(base))
    return problems


def _check_dataset(name: str, path: str, base: Path) -> str | None:
    p = Path(path).expanduser()
    p = p if p.is_absolute() else base / p
    if p.is_file():
        if p.suffix.lower() not in FILE_SUFFIXES:
            return f"{name}: {path} is a {p.suffix or 'suffix-less'} file; give .jsonl or .parquet"
        return None
    if p.is_dir():
        data = [f for f in p.rglob("*") if f.suffix.lower() in (*FILE_SUFFIXES, ".json", ".csv")]
        if is_saved_dataset(p) or data:
            return None
        return (
            f"{name}: {path} is a folder with no dataset in it (neither saved by `datasets` "
            "save_to_disk nor holding .parquet/.jsonl files)"
        )
    return None  # missing: JobConfig.check_files says so


def check_job(config: JobConfig, base: Path, fetch: bool = True) -> Resolved:
    """Check every file, model, dataset and plugin of `config` (relative paths from `base`);
    with `fetch`, download what is named by hub id. Raise one ConfigError listing every problem."""
    problems: list[str] = []
    try:
        config.check_files("all", base)
    except ConfigError as exc:
        problems += [line.strip() for line in str(exc).splitlines()[1:]]
    resolved = Resolved()
    for kind in ("train", "eval"):
        for i, ds in enumerate(getattr(config.data, kind)):
            name = f"data.{kind}[{i}].path"
            if hub.is_hub_id(ds.path, base):
                if fetch:
                    try:
                        resolved.datasets[name] = hub.fetch_dataset(ds.path, ds.revision, name)
                    except ConfigError as exc:
                        problems.append(str(exc))
            else:
                problem = _check_dataset(name, ds.path, base)
                if problem:
                    problems.append(problem)
    models = [("model", config.model.path, config.model.revision, "model.path")]
    rm = config.reward.reward_model
    if rm is not None and "rm" in config.reward.verifiers:
        models.append(("reward_model", rm.path, rm.revision, "reward.reward_model.path"))
    for attr, path, revision, name in models:
        if path and (fetch or not hub.is_hub_id(path, base)):
            try:
                setattr(resolved, attr, hub.resolve_model(path, revision, name, base))
            except ConfigError as exc:
                problems.append(str(exc))
    problems += _check_plugins(config, base)
    if problems:
        unique = list(dict.fromkeys(problems))
        raise ConfigError("the job cannot start:\n  " + "\n  ".join(unique))
    return resolved


def with_local_models(config: JobConfig, service: str) -> JobConfig:
    """The job as `service` should read it: a model it loads that is named by hub id replaced by
    its fetched folder. `kuberl serve` calls this before it binds a port, so a pod fetches once,
    fails at once on a wrong id, and its service code only ever sees a local folder."""
    model, reward = config.model, config.reward
    if service in ("rollout", "trainer") and model.path and hub.is_hub_id(model.path):
        folder = hub.resolve_model(model.path, model.revision, "model.path")
        model = model.model_copy(update={"path": str(folder), "revision": None})
    rm = reward.reward_model
    wants_rm = service == "reward" and "rm" in reward.verifiers
    if wants_rm and rm is not None and hub.is_hub_id(rm.path):
        folder = hub.resolve_model(rm.path, rm.revision, "reward.reward_model.path")
        rm = rm.model_copy(update={"path": str(folder), "revision": None})
        reward = reward.model_copy(update={"reward_model": rm})
    return config.model_copy(update={"model": model, "reward": reward})
