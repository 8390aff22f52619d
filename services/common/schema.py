"""The Helm chart's `values.schema.json`, whose `job` section is generated from `JobConfig`.

`helm install` validates values against `helm/kuberl/values.schema.json` before rendering anything.
Its chart part (images, replicas, autoscaling, ...) is written by hand; its `job` property and the
`job_*` definitions are generated here from the pydantic job models, so `helm install` rejects
exactly the job files the services would reject at start (except cross-field checks, which JSON
Schema cannot express). `kuberl chart schema` rewrites the file; `kuberl chart schema --check` and
tests/helm/test_schema.py fail when the committed file is out of date.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from kuberl.common.config import JobConfig

DRAFT = "http://json-schema.org/draft-07/schema#"
DEF_PREFIX = "job_"
DEFAULT_PATH = Path("helm/kuberl/values.schema.json")


def _to_draft7(node: Any) -> Any:
    """Rewrite pydantic's 2020-12 output into draft-07 keywords, recursively: draft-07 is what
    every Helm 3 and 4 release understands. `prefixItems` (fixed-length tuples) become tuple
    `items`; OpenAPI's `discriminator` (no JSON Schema keyword) is dropped, keeping its `oneOf`.
    (`job_schema` moves `$defs` to draft-07's `definitions`.)"""
    if isinstance(node, list):
        return [_to_draft7(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "discriminator":
            continue
        if key == "prefixItems":
            out["items"] = _to_draft7(value)
            out["additionalItems"] = False
            continue
        out[key] = _to_draft7(value)
    return out


def job_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """The job file's schema and its definitions (named `job_<Model>`), in draft-07."""
    raw = JobConfig.model_json_schema(ref_template="#/definitions/" + DEF_PREFIX + "{model}")
    definitions = {DEF_PREFIX + name: _to_draft7(d) for name, d in raw.pop("$defs", {}).items()}
    root = _to_draft7(raw)
    root["description"] = (
        "The kuberl job file (services/common/config/), rendered into the job ConfigMap. "
        "Generated from kuberl.common.config.JobConfig by `kuberl chart schema`; do not edit."
    )
    return root, definitions


def render_values_schema(current: dict[str, Any]) -> dict[str, Any]:
    """`current` (the chart's schema) with its job section and job definitions regenerated."""
    if not isinstance(current.get("properties"), dict):
        raise ValueError("values.schema.json: expected an object schema with `properties`")
    schema = copy.deepcopy(current)
    schema["$schema"] = DRAFT
    job, job_definitions = job_schema()
    schema["properties"]["job"] = job
    kept = {
        name: d
        for name, d in schema.get("definitions", {}).items()
        if not name.startswith(DEF_PREFIX)
    }
    schema["definitions"] = {**kept, **dict(sorted(job_definitions.items()))}
    return schema


def dumps(schema: dict[str, Any]) -> str:
    """The file's exact text: two-space indentation, a trailing newline."""
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def regenerate(path: Path = DEFAULT_PATH) -> tuple[str, str]:
    """(text on disk, text it should have) for the schema file at path."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise FileNotFoundError(f"{path}: cannot read the chart's schema: {exc.strerror}") from None
    try:
        current = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    return text, dumps(render_values_schema(current))
