"""Files other processes read while they change: written aside, then renamed into place, so a
reader sees the old content or the new, never a half-written file."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path | str, text: str) -> None:
    """Replace `path` with `text` in one rename (same folder, so the same file system)."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)
