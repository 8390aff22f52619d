"""Structured logging for every kuberl process: one line per event, key=value or JSON.

Services call `setup_logging(service)` once at start and log through `get_logger(__name__)`:
`log.info("lease.granted", consumer="rollout-0", n=8)` writes one line like
`ts=2026-11-23T08:00:00.000Z level=info service=buffer logger=kuberl.buffer.store
event=lease.granted consumer=rollout-0 n=8`
(or the same fields as one JSON object with `KUBERL_LOG_FORMAT=json`). No print in services.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

_SERVICE = "kuberl"


class _Formatter(logging.Formatter):
    def __init__(self, fmt: str) -> None:
        super().__init__()
        self.fmt = fmt

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        fields: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": _SERVICE,
            "logger": record.name,
            "event": record.getMessage(),
        }
        fields.update(getattr(record, "kv", {}))
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        if self.fmt == "json":
            return json.dumps(fields, default=str)
        return " ".join(f"{k}={_quote(v)}" for k, v in fields.items())


def _quote(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text == "" or any(c in text for c in ' "=\n'):
        return json.dumps(text)
    return text


class StructLogger:
    """A logger whose calls take an event name and key=value fields."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    def _log(self, level: int, event: str, exc_info: bool, fields: dict[str, Any]) -> None:
        if self._logger.isEnabledFor(level):
            self._logger.log(level, event, extra={"kv": fields}, exc_info=exc_info)

    def debug(self, event: str, **fields: Any) -> None:
        self._log(logging.DEBUG, event, False, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log(logging.INFO, event, False, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log(logging.WARNING, event, False, fields)

    def error(self, event: str, *, exc_info: bool = False, **fields: Any) -> None:
        self._log(logging.ERROR, event, exc_info, fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._log(logging.ERROR, event, True, fields)


def get_logger(name: str) -> StructLogger:
    return StructLogger(logging.getLogger(name))


def setup_logging(service: str, level: str | None = None, fmt: str | None = None) -> None:
    """Send every log record of this process to stderr as one structured line."""
    global _SERVICE
    _SERVICE = service
    fmt = fmt or os.environ.get("KUBERL_LOG_FORMAT", "kv")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("KUBERL_LOG_LEVEL", "info")).upper())
