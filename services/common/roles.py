"""Per-RPC roles: which component of a job may call which method, and how a caller is known.

Every server checks the caller's identity before a restricted method runs. The caller must
belong to this job and its component must be one of the roles `ALLOWED` names for the method;
anything else is PERMISSION_DENIED, counted in `kuberl_<service>_permission_denied_total{method,
role}`. Methods not in the table (reads such as GetStats, GetVersion, health) are open. One
decision, two sources of identity: under mutual TLS with `tls.roles`, the certificate's URI SAN
`spiffe://kuberl/<job>/<component>[/<instance>]` (`Certificates`); in local mode, the secret
token `kuberl run` gives each process for the run, sent as gRPC metadata by every channel of
`kuberl.common.channels` and looked up in the run's identity file (`Tokens`). A server with
neither (started by hand, in a test or benchmark) checks no roles. docs/security.md explains what
each role may do.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kuberl.common import metrics
from kuberl.common.config import ConfigError, TLSConfig
from kuberl.common.errors import PermissionDenied

SCHEME = "spiffe://kuberl/"
#: This process's own token (a client credential), set by `kuberl run` for each process.
TOKEN_ENV = "KUBERL_ROLE_TOKEN"
#: A server's identity file (`issue_tokens`): which token digest names which component.
IDENTITIES_ENV = "KUBERL_ROLE_IDENTITIES"
#: The gRPC metadata key a client's token travels in.
TOKEN_METADATA = "kuberl-role-token"

_BUFFER = "/kuberl.buffer.v1.BufferService/"
_WEIGHT_SYNC = "/kuberl.weight_sync.v1.WeightSyncService/"
_REWARD = "/kuberl.reward.v1.RewardService/"
_ROLLOUT = "/kuberl.rollout.v1.RolloutService/"
ROLLOUT, TRAINER, WEIGHT_SYNC = (
    frozenset({"rollout"}),
    frozenset({"trainer"}),
    frozenset({"weight_sync"}),
)

#: Full method path -> the components that may call it.
ALLOWED: dict[str, frozenset[str]] = {
    **{_BUFFER + m: ROLLOUT for m in ("LeasePrompts", "ReleasePrompts", "PutTrajectories")},
    **{
        _BUFFER + m: TRAINER
        for m in ("GetBatch", "Ack", "SetPolicyVersion", "StartEval", "LoadDataset")
    },
    **{_WEIGHT_SYNC + m: TRAINER for m in ("Publish", "UploadSnapshot", "CommitPublish")},
    **{
        _WEIGHT_SYNC + m: ROLLOUT
        for m in ("RegisterEngine", "Heartbeat", "LeaveEngine", "ReportLoaded", "StreamSnapshot")
    },
    _REWARD + "Score": ROLLOUT,
    _ROLLOUT + "NotifyWeightsUpdate": WEIGHT_SYNC,
}


@dataclass(frozen=True)
class Identity:
    job: str
    component: str
    instance: str = ""

    def __str__(self) -> str:
        return f"{SCHEME}{self.job}/{self.component}" + (
            f"/{self.instance}" if self.instance else ""
        )

    @classmethod
    def parse(cls, job: str, name: str) -> Identity | None:
        """`component` or `component/instance` of `job` (None: not of that form)."""
        parts = name.split("/")
        return cls(job, *parts) if len(parts) in (1, 2) and all(parts) else None


def identity_of(uris: list[str]) -> Identity | None:
    """The kuberl identity among a certificate's URI SANs (None: it has none)."""
    for uri in uris:
        if uri.startswith(SCHEME):
            job, _, name = uri[len(SCHEME) :].partition("/")
            found = Identity.parse(job, name) if job else None
            if found is not None:
                return found
    return None


class IdentitySource(Protocol):
    #: What the refusal says the caller lacked when it presented no identity.
    missing: str

    def identify(self, context: Any) -> Identity | None:
        """The caller's identity (None: it presented none this source accepts)."""


class Certificates:
    """Identities from the caller's certificate (mutual TLS with `tls.roles`)."""

    missing = "no kuberl identity in its certificate (URI SAN spiffe://kuberl/<job>/<component>)"

    def identify(self, context: Any) -> Identity | None:
        auth = context.auth_context() or {}
        uris = [
            v.decode(errors="replace") if isinstance(v, bytes) else str(v)
            for v in auth.get("x509_subject_alternative_name", [])
        ]
        return identity_of(uris)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Tokens:
    """Identities from the per-process tokens of a local run (`issue_tokens`). The server keeps
    only their digests: its identity file gives nobody a token."""

    missing = (
        f"no valid role token (gRPC metadata {TOKEN_METADATA!r}: `kuberl run` gives each of "
        f"its processes its own in {TOKEN_ENV})"
    )

    def __init__(self, identities: dict[str, Identity]) -> None:
        self.identities = identities  # token digest -> identity

    @classmethod
    def load(cls, path: str | Path) -> Tokens:
        try:
            doc = json.loads(Path(path).read_text())
            names = doc["identities"].items()
            found = {d: Identity.parse(doc["job"], name) for d, name in names}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"{IDENTITIES_ENV}={path}: not a readable identity file of a `kuberl run` "
                f"({type(exc).__name__}: {exc}); unset it to check no roles"
            ) from None
        return cls({d: who for d, who in found.items() if who is not None})

    def identify(self, context: Any) -> Identity | None:
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_METADATA:
                token = value.decode(errors="replace") if isinstance(value, bytes) else value
                return self.identities.get(digest(token))
        return None


def issue_tokens(folder: Path, job: str, names: dict[str, str]) -> dict[str, str]:
    """A fresh random token for each process of a local run: `names` maps a process name to
    its identity (`component` or `component/instance`). Writes `folder/<process>.token` and the
    servers' `folder/identities.json` (token digests only), all owner-only; returns the tokens."""
    folder.mkdir(mode=0o700, exist_ok=True)
    folder.chmod(0o700)
    tokens = {process: secrets.token_urlsafe(32) for process in names}
    identities = {digest(tokens[p]): name for p, name in names.items()}
    files = {f"{p}.token": t for p, t in tokens.items()}
    files["identities.json"] = json.dumps({"job": job, "identities": identities}, indent=1)
    for file, text in files.items():
        path = folder / file
        path.unlink(missing_ok=True)  # a resumed run's old file: created anew, owner-only
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
    return tokens


def identity_source(tls: TLSConfig, env: dict[str, str] | None = None) -> IdentitySource | None:
    """Where this server learns its callers' identities: certificates under `tls.roles`, else
    the run's tokens when `kuberl run` named an identity file, else nowhere (no role checks)."""
    if tls.roles:
        return Certificates()
    path = (os.environ if env is None else env).get(IDENTITIES_ENV)
    return Tokens.load(path) if path else None


def own_token() -> str:
    """The token this process presents on its calls ('' outside a local run)."""
    return os.environ.get(TOKEN_ENV, "")


def require_instance(source: IdentitySource, context: Any, instance: str, what: str) -> None:
    """The caller's identity must name `instance` (an engine registers, beats and reports as
    itself only: .../rollout/<engine id>)."""
    who = source.identify(context)
    if who is None or who.instance != instance:
        raise PermissionDenied(
            f"{what} {instance!r} may only be acted for by its own identity "
            f".../{instance}; the caller presents {who or source.missing}"
        )


class RoleCheck:
    """The allow-list of one service of `job` (see the module docstring)."""

    def __init__(self, service: str, job: str, source: IdentitySource) -> None:
        self.job = job
        self.source = source
        self.denied = metrics.counter(
            f"kuberl_{service}_permission_denied_total",
            "Calls refused because the caller's role may not call the method",
            ["method", "role"],
        )

    @staticmethod
    def restricted(path: str) -> bool:
        return path in ALLOWED

    def check(self, path: str, context: Any) -> None:
        """Raise PermissionDenied unless the caller is a role of this job that may call
        `path`."""
        allowed = ALLOWED.get(path)
        if allowed is None:
            return
        who = self.source.identify(context)
        if who is not None and who.job == self.job and who.component in allowed:
            return
        method = path.rsplit("/", 1)[-1]
        role = "none" if who is None else who.component if who.job == self.job else "other_job"
        self.denied.labels(method, role).inc()
        raise PermissionDenied(
            f"{method} may be called by {', '.join(sorted(allowed))} of job {self.job!r} only; "
            f"the caller presents {who or self.source.missing}"
        )
