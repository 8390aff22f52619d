"""Overrides of the job file: environment variables `KUBERL_<SECTION>__<FIELD>[__<SUB>...]` and
command-line `section.field.sub=value` (`kuberl run job.yaml trainer.optimizer.lr=1e-6`).

Both go through `parse_value`: values are YAML scalars (`KUBERL_TRAINER__ZERO_STAGE=2` is an
int), except for fields that hold only text, which take the value as written. A list element is
addressed by its index (`data.train.0.path=...` or `data.train[0].path=...`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel

from kuberl.common.config.base import ConfigError, models_in
from kuberl.common.config.jobfile import SECTIONS, JobConfig

ENV_PREFIX = "KUBERL_"


def set_path(data: dict[str, Any], path: list[str], value: Any, origin: str) -> None:
    """Set data[path[0]][path[1]]... = value, creating sections on the way (a list is indexed
    by a number: it must already have that element)."""
    node: Any = data
    for i, key in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ConfigError(
                    f"{origin}: {'.'.join(path)}: {'.'.join(path[:i])} is a list of {len(node)}; "
                    f"index it with 0..{len(node) - 1}"
                )
            if last:
                node[int(key)] = value
            else:
                node = node[int(key)]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"{origin}: {'.'.join(path)}: {path[i - 1]} is not a section")
        if last:
            node[key] = value
        else:
            node = node.setdefault(key, {})


def parse_value(path: list[str], raw: str, origin: str) -> Any:
    """An override's text as the value of the field at `path` (see the module docstring)."""
    text = _takes_a_string(path)
    if raw == "" or (text and not (text == "optional" and raw in ("null", "~"))):
        return raw  # as written: YAML would read 2024, no, or '#...' otherwise
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        problem = str(exc).splitlines()[0]
        raise ConfigError(
            f"{origin}: {'.'.join(path)}: not a YAML value ({problem}); quote it"
        ) from None


def _check_section(path: list[str], origin: str) -> None:
    if path[0] not in SECTIONS:
        from kuberl.common.config.errors import closest_field

        hint = closest_field(path)
        raise ConfigError(
            f"{origin}: unknown section {path[0]!r}"
            + (f"; did you mean {hint!r}?" if hint else f"; expected one of {', '.join(SECTIONS)}")
        )


def cli_overrides(items: Sequence[str]) -> list[tuple[list[str], Any, str]]:
    """Command-line `section.field=value` items as (path, parsed value, the item as written)."""
    found = []
    for item in items:
        key, sep, raw = item.partition("=")
        path = [p for p in re.split(r"\.|\[(\d+)\]\.?", key.strip()) if p]
        if not sep or not path:
            raise ConfigError(
                f"override {item!r}: expected section.field=value (e.g. trainer.optimizer.lr=1e-6)"
            )
        origin = f"override {key.strip()}"
        _check_section(path, origin)
        found.append((path, parse_value(path, raw, origin), origin))
    return found


def env_overrides(env: Mapping[str, str]) -> list[tuple[list[str], Any, str]]:
    """The `KUBERL_<SECTION>__<FIELD>` variables in env as (path, parsed value, origin)."""
    found = []
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
        _check_section(path, f"environment {name}")
        found.append((path, parse_value(path, raw, f"environment {name}"), f"environment {name}"))
    return found


def _takes_a_string(path: list[str]) -> str:
    """ "text" when the field at `path` holds only text (str, a Literal of strings), "optional"
    for str | None (whose `null` or `~` stays None), else ""."""
    models: list[type[BaseModel]] = [JobConfig]
    annotation: Any = None
    path = [p for p in path if not p.isdigit()]  # list indices: the element's model
    for i, part in enumerate(path):
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if not fields:
            return ""
        annotation = fields[0].annotation
        if i < len(path) - 1:
            models = models_in(annotation)
    if get_origin(annotation) in (list, dict):  # YAML: [a, b] and {k: v}
        return ""
    if get_origin(annotation) is Literal:
        return "text" if all(isinstance(v, str) for v in get_args(annotation)) else ""
    args = get_args(annotation) or (annotation,)
    kinds = [a for a in args if a is not type(None)]
    if kinds != [str]:
        return ""
    return "optional" if type(None) in args else "text"
