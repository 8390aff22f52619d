"""Pydantic's validation errors as lines a person can act on: field path, problem, input,
a "did you mean" for unknown fields, and which environment variable set the value."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel

from kuberl.common.config.base import models_in
from kuberl.common.config.jobfile import JobConfig


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
    return f"; known fields here: {', '.join(known)}" if known else ""


def describe_error(err: dict[str, Any], origins: dict[str, str]) -> str:
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
    where = f" (from {origins[loc]})" if loc in origins else ""
    got = err.get("input")
    got_text = "" if err["type"] == "missing" or isinstance(got, dict) else f" (got {got!r})"
    hint = _unknown_field_hint(tuple(err["loc"])) if err["type"] == "extra_forbidden" else ""
    return f"{loc or '<job>'}: {err['msg']}{got_text}{hint}{where}"
