"""The base of every job-file model, the listener settings each service has, and ConfigError."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """Base of every config model: unknown fields are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


class ServerConfig(Section):
    """How one service listens."""

    host: str = Field("0.0.0.0", description="Address the gRPC server binds to.")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free port.")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free port."
    )
    max_message_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024,
        description="Largest gRPC message sent or received (gRPC's own default is only 4 MiB).",
    )
    grace_seconds: float = Field(
        10.0, ge=0, description="On SIGTERM, how long in-flight calls may run before cancellation."
    )


def server_field(port: int, metrics_port: int) -> Any:
    return Field(
        default_factory=lambda: ServerConfig(port=port, metrics_port=metrics_port),
        description="gRPC and metrics listeners of this service.",
    )


class ConfigError(ValueError):
    """The job file or an override is wrong; the message lists every problem by field path."""


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, unions, lists, dicts)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in models_in(arg)]
