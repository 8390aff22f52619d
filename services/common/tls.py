"""Transport security of kuberl's gRPC connections: TLS and mutual TLS from the job's `tls` section.

`kuberl.common.server.serve` binds with `server_credentials(tls)` and `kuberl.common.channels` opens
every client channel with `channel_credentials(tls)`, so one `tls` section in the job file secures
every connection between services. gRPC reads the PEM files itself; nothing here parses certificates
(no `cryptography` at run time).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import grpc
import yaml

from kuberl.common.config import ENV_PREFIX, ConfigError, RedisConfig, TLSConfig
from kuberl.common.logs import get_logger

log = get_logger(__name__)

ENV_SECTION = f"{ENV_PREFIX}TLS__"

_lock = threading.Lock()
_default: TLSConfig | None = None


class TLSError(ConfigError):
    """A TLS file is missing or unreadable, or the settings cannot work for this role."""


def configure(tls: TLSConfig | None) -> None:
    """Make `tls` this process's default for channels opened without explicit settings
    (None: back to the environment / plaintext default)."""
    global _default
    with _lock:
        _default = tls


def from_env(env: dict[str, str] | None = None) -> TLSConfig:
    """The `tls` section as the `KUBERL_TLS__<FIELD>` variables give it (plaintext if none)."""
    env = dict(os.environ if env is None else env)
    fields = {
        name[len(ENV_SECTION) :].lower(): yaml.safe_load(value) if value != "" else ""
        for name, value in env.items()
        if name.startswith(ENV_SECTION)
    }
    try:
        return TLSConfig.model_validate(fields)
    except ValueError as exc:
        raise TLSError(f"environment {ENV_SECTION}*: {exc}") from None


def current() -> TLSConfig:
    """The settings channels use when none are given: what `serve()` `configure`d (a service's
    own outgoing channels follow the job file), else, in a process that never serves (`kuberl
    health`, `kuberl buffer stats`), the `KUBERL_TLS__<FIELD>` variables, else plaintext."""
    with _lock:
        if _default is not None:
            return _default
    return from_env()


def read_pem(path: str | None, field: str) -> bytes | None:
    """The bytes of a PEM file named by `tls.<field>`; TLSError naming the field if unreadable."""
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TLSError(
            f"tls.{field}: cannot read {path}: {exc.strerror}; mount the TLS secret there or "
            "fix the path"
        ) from None
    if b"-----BEGIN" not in data:
        raise TLSError(f"tls.{field}: {path} is not a PEM file (no -----BEGIN line)")
    return data


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    """Client credentials: verify servers against ca_file; present a certificate for mTLS."""
    cert_file = tls.client_cert_file or tls.cert_file
    key_file = tls.client_key_file or tls.key_file
    cert_field = "client_cert_file" if tls.client_cert_file else "cert_file"
    key_field = "client_key_file" if tls.client_key_file else "key_file"
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(tls.ca_file, "ca_file"),
        private_key=read_pem(key_file, key_field),
        certificate_chain=read_pem(cert_file, cert_field),
    )


def channel_options(tls: TLSConfig) -> list[tuple[str, Any]]:
    """Extra channel options: the expected server name when it differs from the dialled host."""
    if tls.enabled and tls.server_name_override:
        return [("grpc.ssl_target_name_override", tls.server_name_override)]
    return []


class _ServerFiles:
    """The server's PEM files, re-read for new connections when their modification times
    change. Called by gRPC on every handshake; returns None to keep the current certificate."""

    def __init__(self, tls: TLSConfig) -> None:
        if not (tls.cert_file and tls.key_file):
            raise TLSError(
                "tls.enabled: a server needs its certificate: set tls.cert_file and tls.key_file"
            )
        self.tls = tls
        self.paths = [p for p in (tls.cert_file, tls.key_file, tls.ca_file) if p]
        self.stamp = self._stamp()
        self.config = self._load()

    def _stamp(self) -> tuple[int, ...]:
        return tuple(os.stat(p).st_mtime_ns for p in self.paths)

    def _load(self) -> Any:
        key = read_pem(self.tls.key_file, "key_file")
        cert = read_pem(self.tls.cert_file, "cert_file")
        assert key is not None and cert is not None
        return grpc.ssl_server_certificate_configuration(
            [(key, cert)], root_certificates=read_pem(self.tls.ca_file, "ca_file")
        )

    def fetch(self) -> Any:
        try:
            stamp = self._stamp()
            if stamp == self.stamp:
                return None
            config = self._load()
        except (OSError, TLSError) as exc:  # mid-rotation: keep serving the old certificate
            log.warning("tls.reload_failed", error=str(exc))
            return None
        self.stamp = stamp
        log.info("tls.reloaded", cert_file=self.tls.cert_file)
        return config


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """Server credentials for `tls` (enabled): the service's certificate, and with
    require_client_cert the CA that client certificates must chain to. The files are re-read
    when they change (checked on each new connection), so a rotated certificate (cert-manager)
    is served without a restart; a file caught half-written keeps the previous one. Clients
    read their files when a channel is opened."""
    files = _ServerFiles(tls)
    return grpc.dynamic_ssl_server_credentials(
        files.config, files.fetch, require_client_authentication=tls.require_client_cert
    )


def redis_options(redis: RedisConfig) -> dict[str, Any]:
    """Keyword arguments for `redis.Redis.from_url` that make a rediss:// connection verify the
    server against `redis.tls_ca_file` and present `redis.tls_cert_file` when set (empty for a
    redis:// URL). The password comes separately, from `redis.password_env`."""
    if not (redis.url or "").startswith("rediss://"):
        return {}
    options: dict[str, Any] = {"ssl_cert_reqs": "required"}
    if redis.tls_ca_file:
        options["ssl_ca_certs"] = redis.tls_ca_file
    if redis.tls_cert_file and redis.tls_key_file:
        options["ssl_certfile"] = redis.tls_cert_file
        options["ssl_keyfile"] = redis.tls_key_file
    return options
