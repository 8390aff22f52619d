"""The `redis` section: where the job's Redis is and how to reach it."""

from __future__ import annotations

from pydantic import Field, model_validator

from kuberl.common.config.base import Section


class RedisConfig(Section):
    url: str | None = Field(
        None,
        description="redis:// or rediss:// URL of the job's Redis; null starts an embedded "
        "server (local mode only).",
    )
    password_env: str = Field(
        "REDIS_PASSWORD", description="Environment variable holding the Redis password, if any."
    )
    connect_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="How long a service waits for Redis at start, and how long a request keeps "
        "retrying while Redis is unreachable (e.g. restarting) before answering UNAVAILABLE.",
    )
    tls_ca_file: str | None = Field(
        None,
        description="PEM CA bundle that signed the Redis server's certificate (rediss:// URLs; "
        "null: the system's CAs).",
    )
    tls_cert_file: str | None = Field(
        None,
        description="PEM client certificate for a Redis that requires one (`tls-auth-clients`).",
    )
    tls_key_file: str | None = Field(None, description="Private key of `tls_cert_file` (PEM).")

    @model_validator(mode="after")
    def _tls_files(self) -> RedisConfig:
        if self.url is not None and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"url {self.url!r} is not a Redis URL: use redis://host:port/db, "
                "rediss://host:port/db (TLS) or unix:///path/to/socket"
            )
        tls_set = self.tls_ca_file or self.tls_cert_file or self.tls_key_file
        if tls_set and not (self.url or "").startswith("rediss://"):
            raise ValueError(
                "tls_*_file are set but url is not rediss:// (the embedded server has no TLS): "
                "use url: rediss://host:port/0 for TLS, or remove the tls_*_file fields"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        return self
