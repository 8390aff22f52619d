"""Per-RPC roles under mutual TLS: which component of a job may call which method.

With `tls.roles`, every server checks the caller's certificate identity before a restricted
method runs: a URI SAN `spiffe://kuberl/<job>/<component>` (optionally `/<instance>` after it,
e.g. a replica's pod name). The caller must belong to this job and its component must be one of
the roles `ALLOWED` names for the method; anything else is PERMISSION_DENIED, counted in
`kuberl_<service>_permission_denied_total{method,role}`. Methods not in the table (reads such as
GetStats, GetVersion, health) are open to every caller the CA admitted. docs/security.md
explains what each role may do and what the chart must issue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kuberl.common import metrics
from kuberl.common.errors import PermissionDenied

SCHEME = "spiffe://kuberl/"

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


def identity_of(uris: list[str]) -> Identity | None:
    """The kuberl identity among a certificate's URI SANs (None: it has none)."""
    for uri in uris:
        if uri.startswith(SCHEME):
            parts = uri[len(SCHEME) :].split("/")
            if len(parts) in (2, 3) and all(parts):
                return Identity(*parts)
    return None


def _peer_uris(context: Any) -> list[str]:
    """URI SANs of the caller's certificate (gRPC lists every SAN, URIs among them)."""
    auth = context.auth_context() or {}
    return [
        v.decode(errors="replace") if isinstance(v, bytes) else str(v)
        for v in auth.get("x509_subject_alternative_name", [])
    ]


def require_instance(context: Any, instance: str, what: str) -> None:
    """Under roles: the caller's identity must name `instance` (an engine registers, beats and
    reports as itself only: spiffe://kuberl/<job>/rollout/<engine id>)."""
    who = identity_of(_peer_uris(context))
    if who is None or who.instance != instance:
        raise PermissionDenied(
            f"{what} {instance!r} may only be acted for by its own identity "
            f".../{instance}; the caller's certificate names {who or 'no kuberl identity'}"
        )


class RoleCheck:
    """The allow-list of one service of `job` (see the module docstring)."""

    def __init__(self, service: str, job: str) -> None:
        self.job = job
        self.denied = metrics.counter(
            f"kuberl_{service}_permission_denied_total",
            "Calls refused because the caller's role may not call the method",
            ["method", "role"],
        )

    @staticmethod
    def restricted(path: str) -> bool:
        return path in ALLOWED

    def check(self, path: str, context: Any) -> None:
        """Raise PermissionDenied unless the caller's certificate names a role of this job
        that may call `path`."""
        allowed = ALLOWED.get(path)
        if allowed is None:
            return
        who = identity_of(_peer_uris(context))
        if who is not None and who.job == self.job and who.component in allowed:
            return
        method = path.rsplit("/", 1)[-1]
        role = "none" if who is None else who.component if who.job == self.job else "other_job"
        self.denied.labels(method, role).inc()
        raise PermissionDenied(
            f"{method} may be called by {', '.join(sorted(allowed))} of job {self.job!r} only; "
            f"the caller's certificate names {who or 'no kuberl identity (URI SAN spiffe://kuberl/<job>/<component>)'}"
        )
