"""Models and datasets named by Hugging Face id, fetched once into the Hugging Face cache.

Every loader calls `resolve_model` (trainer, torch engine, SGLang launch through
`kuberl.common.modelbuild.resolve_model`; the reward model) and the buffer's dataset reader calls
`fetch_dataset`; the local supervisor calls both before any service starts, so a wrong id or a
missing download fails once, with the field that named it. A local path is used as is. Anything
else of an id's shape (`org/name`) is fetched with `huggingface_hub.snapshot_download` into its
cache (`HF_HOME`, default `~/.cache/huggingface`; the chart points it at the models volume), with
the token of `HF_TOKEN` and the endpoint of `HF_ENDPOINT`. Offline (`HF_HUB_OFFLINE=1`, or no
network) a cached snapshot is used; a missing one is a ConfigError with the command that fetches
it by hand.
"""

from __future__ import annotations

import re
from pathlib import Path

from kuberl.common.config.base import ConfigError

#: `name` or `org/name`, as the hub spells repository ids.
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
#: Suffixes that make a path a file, never a repository id.
FILE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv", ".txt", ".arrow", ".yaml")


def is_hub_id(path: str, base: Path | None = None) -> bool:
    """Whether `path` names a hub repository: it is no local path (nothing there, no leading
    `/`, `.` or `~`, no file suffix) and has an id's shape."""
    local = Path(path).expanduser()
    if not local.is_absolute() and base is not None:
        local = base / local
    return not (
        local.exists()
        or path.startswith(("/", ".", "~"))
        or path.lower().endswith(FILE_SUFFIXES)
        or not REPO_ID.fullmatch(path)
    )


def fetch_command(repo_id: str, revision: str | None, repo_type: str = "model") -> str:
    """The command that fetches a repository by hand into the same cache."""
    kind = " --repo-type dataset" if repo_type == "dataset" else ""
    rev = f" --revision {revision}" if revision else ""
    return f"hf download {repo_id}{kind}{rev}"


def _snapshot(repo_id: str, revision: str | None, repo_type: str, field: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    by_hand = (
        f"fetch it by hand where the hub is reachable, into the same HF_HOME: "
        f"`{fetch_command(repo_id, revision, repo_type)}`"
    )
    where = f"{field}: {repo_id}" + (f" (revision {revision})" if revision else "")
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision))
    except GatedRepoError:
        problem = "is gated: accept its terms on the hub and set HF_TOKEN"
    except RevisionNotFoundError:
        problem = "has no such revision on the hub; fix the revision"
    except RepositoryNotFoundError:
        problem = (
            f"is no local path and no {repo_type} on the hub (or a private one: set HF_TOKEN); "
            "fix the path or the id"
        )
    except LocalEntryNotFoundError:
        offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub is unreachable"
        problem = f"is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {offline}; "
        problem += by_hand
    except (HfHubHTTPError, OSError) as exc:
        problem = f"could not be fetched ({type(exc).__name__}: {exc}); {by_hand}"
    raise ConfigError(f"{where} {problem}")


def resolve_model(
    path: str, revision: str | None = None, field: str = "model.path", base: Path | None = None
) -> Path:
    """The local folder of a model: `path` itself when it is local, else the cached snapshot of
    the hub id `path` at `revision`. ConfigError names `field` when there is no HF model there."""
    if is_hub_id(path, base):
        folder = _snapshot(path, revision, "model", field)
    else:
        folder = Path(path).expanduser()
        if not folder.is_absolute() and base is not None:
            folder = base / folder
    if not (folder / "config.json").exists():
        what = "does not exist" if not folder.exists() else "has no config.json"
        raise ConfigError(
            f"{field}: {folder} {what} (a Hugging Face model folder has config.json); give a "
            "local model folder or a hub id such as Qwen/Qwen2.5-0.5B-Instruct"
        )
    return folder


def fetch_dataset(repo_id: str, revision: str | None = None, field: str = "data.path") -> Path:
    """The cached snapshot of the hub dataset `repo_id` (its parquet/jsonl files)."""
    return _snapshot(repo_id, revision, "dataset", field)
