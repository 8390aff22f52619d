"""Reading, validating and writing job files; the entry points every service calls."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kuberl.common.config.base import ConfigError
from kuberl.common.config.env import cli_overrides, env_overrides, set_path
from kuberl.common.config.errors import describe_error
from kuberl.common.config.jobfile import JobConfig


def parse_job_config(
    data: Mapping[str, Any] | None,
    env: Mapping[str, str] | None = None,
    source: str = "<job>",
    overrides: Sequence[str] = (),
) -> JobConfig:
    """Validate a job document after applying env overrides, then the command line's
    `section.field=value` overrides; raise ConfigError on any problem."""
    if not isinstance(data, Mapping | type(None)):
        raise ConfigError(f"{source}: the job file must be a mapping of sections")
    doc: dict[str, Any] = copy.deepcopy(dict(data or {}))  # overrides never reach the caller's
    origins: dict[str, str] = {}
    changes = env_overrides(os.environ if env is None else env) + cli_overrides(overrides)
    for path, value, origin in changes:
        set_path(doc, path, value, origin)
        origins[".".join(path)] = origin
    try:
        return JobConfig.model_validate(doc)
    except ValidationError as exc:
        lines = [describe_error(dict(e), origins) for e in exc.errors()]
        raise ConfigError(
            f"{source}: invalid job configuration:\n  " + "\n  ".join(lines)
        ) from None


def load_job_config(
    path: str | Path | None,
    env: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
) -> JobConfig:
    """Read a job YAML file (None: defaults only) and validate it with env and command-line
    overrides."""
    if path is None:
        return parse_job_config({}, env, "<defaults>", overrides)
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the job file: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(
            f"{p}: the job file must be a mapping of sections, got {type(data).__name__}"
        )
    return parse_job_config(data, env, str(p), overrides)


def dump_job_config(config: JobConfig) -> str:
    """The resolved job as YAML (what a run folder records)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
