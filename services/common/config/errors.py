"""Pydantic's validation errors as lines a person can act on: field path, problem, input,
a "did you mean" for unknown fields (the closest field across sections when none is close
here), and which environment variable or command-line override set the value."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from kuberl.common.config.base import models_in
from kuberl.common.config.jobfile import JobConfig


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field of `model` as a dotted path, sections and their fields alike."""
    paths = []
    for name, field in model.model_fields.items():
        paths.append(prefix + name)
        for inner in models_in(field.annotation):
            paths += _field_paths(inner, f"{prefix}{name}.")
    return paths


def closest_field(path: Sequence[Any]) -> str | None:
    """The job field a wrong key most likely meant, across sections: a field of exactly that name
    anywhere (`trainer.lr` -> `trainer.optimizer.lr`), else the closest dotted path."""
    parts = [str(p) for p in path if not str(p).isdigit()]
    paths = sorted(set(_field_paths(JobConfig)), key=lambda p: (p.count("."), p))
    wanted = ".".join(parts)
    same_name = [p for p in paths if p.rsplit(".", 1)[-1] == parts[-1] and p != wanted]
    if same_name:
        same_section = [p for p in same_name if p.split(".")[0] == parts[0]]
        return (same_section or same_name)[0]
    close = difflib.get_close_matches(wanted, paths, n=1, cutoff=0.75)
    return close[0] if close else None


def _unknown_field_hint(loc: tuple[Any, ...]) -> str:
    """'; did you mean X?' (or the known names) for an unknown key at loc."""
    models: list[type[BaseModel]] = [JobConfig]
    for part in loc[:-1]:
        inner = [
            m
            for model in models
            if isinstance(part, str) and part in model.model_fields
            for m in models_in(model.model_fields[part].annotation)
        ]
        if inner:
            models = inner
        elif isinstance(part, str):  # a discriminator tag (engine kind) or a dict key
            tagged = [
                m for m in models if getattr(m.model_fields.get("kind"), "default", 0) == part
            ]
            models = tagged or models
    known = sorted({name for model in models for name in model.model_fields})
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    elsewhere = closest_field(loc)
    if elsewhere:
        return f"; did you mean {elsewhere!r}?"
    return f"; known fields here: {', '.join(known)}" if known else ""


def describe_error(err: dict[str, Any], origins: dict[str, str]) -> str:
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
    where = f" (from {origins[loc]})" if loc in origins else ""
    got = err.get("input")
    got_text = "" if err["type"] == "missing" or isinstance(got, dict) else f" (got {got!r})"
    hint = _unknown_field_hint(tuple(err["loc"])) if err["type"] == "extra_forbidden" else ""
    return f"{loc or '<job>'}: {err['msg']}{got_text}{hint}{where}"
