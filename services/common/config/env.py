"""Environment overrides of the job file: `KUBERL_<SECTION>__<FIELD>[__<SUBFIELD>...]`.

Values are parsed as YAML scalars (`KUBERL_TRAINER__ZERO_STAGE=2` is an int), except for fields
that hold only text, which take the variable as written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel

from kuberl.common.config.base import ConfigError, models_in
from kuberl.common.config.jobfile import SECTIONS, JobConfig

ENV_PREFIX = "KUBERL_"


def set_path(data: dict[str, Any], path: list[str], value: Any, origin: str) -> None:
    """Set data[path[0]][path[1]]... = value, creating sections on the way."""
    node = data
    for key in path[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: {'.'.join(path)}: {key} is not a section")
        node = child
    node[path[-1]] = value


def env_overrides(env: Mapping[str, str]) -> list[tuple[list[str], Any, str]]:
    """The `KUBERL_<SECTION>__<FIELD>` variables in env as (path, parsed value, variable name)."""
    found = []
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
        if path[0] not in SECTIONS:
            raise ConfigError(
                f"environment {name}: unknown section {path[0]!r}; expected one of "
                f"{', '.join(SECTIONS)}"
            )
        text = _takes_a_string(path)
        if raw == "" or (text and not (text == "optional" and raw in ("null", "~"))):
            value: Any = raw  # as written: YAML would read 2024, no, or '#...' otherwise
        else:
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError as exc:
                problem = str(exc).splitlines()[0]
                raise ConfigError(
                    f"environment {name}: {'.'.join(path)}: not a YAML value ({problem}); quote it"
                ) from None
        found.append((path, value, name))
    return found


def _takes_a_string(path: list[str]) -> str:
    """ "text" when the field at `path` holds only text (str, a Literal of strings), "optional"
    for str | None (whose `null` or `~` stays None), else ""."""
    models: list[type[BaseModel]] = [JobConfig]
    annotation: Any = None
    for i, part in enumerate(path):
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if not fields:
            return ""
        annotation = fields[0].annotation
        if i < len(path) - 1:
            models = models_in(annotation)
    if get_origin(annotation) is Literal:
        return "text" if all(isinstance(v, str) for v in get_args(annotation)) else ""
    args = get_args(annotation) or (annotation,)
    kinds = [a for a in args if a is not type(None)]
    if kinds != [str]:
        return ""
    return "optional" if type(None) in args else "text"
