"""The `tls` section: TLS and mutual TLS of every gRPC connection of the job."""

from __future__ import annotations

from pydantic import Field, model_validator

from kuberl.common.config.base import Section


class TLSConfig(Section):
    """TLS and mutual TLS for every gRPC server and client of the job (`kuberl.common.tls`).

    Off by default: local mode talks over loopback, and on Kubernetes NetworkPolicies already
    limit who reaches a service. When enabled, every service serves TLS with `cert_file` /
    `key_file`, and verifies the services it calls against `ca_file`. With
    `require_client_cert` (mutual TLS) servers also refuse any caller without a certificate
    signed by `ca_file`, and every client presents `client_cert_file` / `client_key_file` (by
    default the same pair as the server: issue it for both serverAuth and clientAuth). Files are
    PEM; servers re-read them when they change, so a rotated certificate (cert-manager) is
    served to new connections without a restart. docs/security.md shows a set-up."""

    enabled: bool = Field(False, description="Serve and call gRPC over TLS.")
    ca_file: str | None = Field(
        None,
        description="PEM CA bundle that verifies peers: the servers a service calls and, with "
        "require_client_cert, the clients calling it (null: the system's CAs, clients only).",
    )
    cert_file: str | None = Field(
        None, description="PEM certificate chain the servers present (SANs: the service names)."
    )
    key_file: str | None = Field(None, description="Private key of cert_file (PEM).")
    require_client_cert: bool = Field(
        False, description="Mutual TLS: refuse callers without a certificate signed by ca_file."
    )
    client_cert_file: str | None = Field(
        None, description="PEM certificate clients present under mutual TLS (null: cert_file)."
    )
    client_key_file: str | None = Field(
        None, description="Private key of client_cert_file (null: key_file)."
    )
    server_name_override: str | None = Field(
        None,
        description="Name clients expect in the servers' certificates instead of the host they "
        "dial (e.g. one certificate for every service; testing only otherwise).",
    )
    roles: bool = Field(
        False,
        description="Per-RPC roles (mutual TLS only): each component's certificate names it "
        "with a URI SAN spiffe://kuberl/<job>/<component>[/<instance>], and each service lets "
        "only the roles that need them call its state-changing methods (rollout leases and "
        "puts, the trainer reads, acknowledges, sets versions and publishes); anything else is "
        "PERMISSION_DENIED. Needs one certificate per component (docs/security.md).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TLSConfig:
        if not self.enabled:
            if self.require_client_cert:
                raise ValueError(
                    "require_client_cert needs TLS: set tls.enabled: true (and the files)"
                )
            return self
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together: set both or neither")
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise ValueError(
                "client_cert_file and client_key_file go together: set both or neither"
            )
        if self.roles and not self.require_client_cert:
            raise ValueError(
                "tls.roles reads the caller's certificate: set tls.require_client_cert: true"
            )
        if self.require_client_cert:
            if not self.ca_file:
                raise ValueError(
                    "require_client_cert: servers check client certificates against ca_file; "
                    "set tls.ca_file to the CA that signs them"
                )
            if not (self.cert_file or self.client_cert_file):
                raise ValueError(
                    "require_client_cert: clients must present a certificate; set "
                    "tls.cert_file/key_file (or tls.client_cert_file/client_key_file)"
                )
        return self
