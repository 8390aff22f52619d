"""Per-RPC roles in the chart (`tls.roles.enabled`): the job file turns them on, every component
mounts its own certificate, and each certificate names exactly the identity kuberl.common.roles
reads from it (checked with roles.py's own parser, so the chart and the services cannot drift)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kuberl.common.config import parse_job_config
from kuberl.common.roles import ALLOWED, Identity, identity_of
from tests.helm.chart import FULLNAME, pod_spec, render, render_values, workloads

JOB = "gsm8k-grpo"  # the tls-roles value set's job.job.name
SERVER_NAME = f"{FULLNAME}-grpc"
# The Secret each workload's pods mount: the chart's Certificates', the trainer's made ahead.
SECRETS = {
    f"{FULLNAME}-buffer": f"{FULLNAME}-buffer-tls",
    f"{FULLNAME}-reward": f"{FULLNAME}-reward-tls",
    f"{FULLNAME}-weight-sync": f"{FULLNAME}-weight-sync-tls",
    f"{FULLNAME}-trainer": "trainer-from-vault",
    # Health is open to every caller; the buffer role may call no restricted method.
    f"{FULLNAME}-test-health": f"{FULLNAME}-buffer-tls",
}
ROLES_ON: dict[str, Any] = {"enabled": True, "roles": {"enabled": True}}
ISSUER = {"certManager": {"issuerRef": {"name": "kuberl-ca"}}}


def _tls_volume(doc: dict[str, Any]) -> dict[str, Any]:
    """The certificate volume of a kuberl pod ({} for Redis, which has none)."""
    return next((v for v in pod_spec(doc)["volumes"] if v["name"] == "grpc-tls"), {})


def test_the_job_file_turns_roles_on_and_loads_with_the_real_loader() -> None:
    job = yaml.safe_load(render("tls-roles").get("ConfigMap", "job")["data"]["job.yaml"])
    config = parse_job_config(job, env={}, source="job ConfigMap (tls-roles)")
    assert (config.tls.roles, config.tls.require_client_cert, config.job.name) == (True, True, JOB)
    assert (
        "roles"
        not in yaml.safe_load(render("mutual-tls").get("ConfigMap", "job")["data"]["job.yaml"])[
            "tls"
        ]
    )


def test_every_kuberl_container_has_roles_in_its_tls_environment() -> None:
    for doc in workloads(render("tls-roles")):
        for c in pod_spec(doc)["containers"]:
            if c["name"] in ("sglang", "redis"):
                continue
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert env["KUBERL_TLS__ROLES"] == "true", c["name"]


def test_each_component_mounts_its_own_certificate_not_the_shared_one() -> None:
    rendered = render("tls-roles")
    mounted = {
        d["metadata"]["name"]: _tls_volume(d)["secret"]
        for d in workloads(rendered)
        if "secret" in _tls_volume(d)
    }
    assert mounted == {
        name: {"secretName": secret, "defaultMode": 0o440} for name, secret in SECRETS.items()
    }


def test_the_certificates_name_exactly_the_identities_the_services_check() -> None:
    certificates = render("tls-roles").all("Certificate")
    by_secret = {c["spec"]["secretName"]: c for c in certificates}
    # The trainer brings its own Secret, so the chart makes no Certificate for it.
    assert set(by_secret) == {SECRETS[f"{FULLNAME}-{c}"] for c in ("buffer", "reward")} | {
        f"{FULLNAME}-weight-sync-tls"
    }
    for role in ("buffer", "reward", "weight_sync"):
        cert = by_secret[f"{FULLNAME}-{role.replace('_', '-')}-tls"]
        assert identity_of(cert["spec"]["uris"]) == Identity(JOB, role)
        assert cert["spec"]["uris"] == [str(Identity(JOB, role))]
        assert cert["spec"]["dnsNames"] == [SERVER_NAME]
        assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
        assert cert["spec"]["issuerRef"] == {
            "name": "kuberl-ca",
            "kind": "ClusterIssuer",
            "group": "cert-manager.io",
        }
    # weight-sync calls rollout's NotifyWeightsUpdate under the role its certificate names.
    assert "weight_sync" in ALLOWED["/kuberl.rollout.v1.RolloutService/NotifyWeightsUpdate"]


def test_each_rollout_pod_gets_a_certificate_naming_its_engine_id() -> None:
    # weight-sync lets an engine act only under an identity ending in its engine id, the
    # replica id, which the chart sets to the pod name; the csi-driver fills in ${POD_NAME}.
    rollout = render("tls-roles").get("Deployment", "rollout")
    csi = _tls_volume(rollout)["csi"]
    assert (csi["driver"], csi["readOnly"]) == ("csi.cert-manager.io", True)
    attributes = csi["volumeAttributes"]
    pod = "rl-kuberl-rollout-7d9f8b6c4-x2x9q"
    uri = attributes["csi.cert-manager.io/uri-sans"].replace("${POD_NAME}", pod)
    assert identity_of([uri]) == Identity(JOB, "rollout", pod)
    container = next(c for c in pod_spec(rollout)["containers"] if c["name"] == "rollout")
    env = {e["name"]: e for e in container["env"]}
    assert env["KUBERL_ROLLOUT__REPLICA_ID"]["value"] == "$(POD_NAME)"
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert attributes["csi.cert-manager.io/dns-names"] == SERVER_NAME
    usages = attributes["csi.cert-manager.io/key-usages"].split(",")
    assert {"server auth", "client auth"} <= set(usages)
    assert (
        attributes["csi.cert-manager.io/issuer-name"],
        attributes["csi.cert-manager.io/issuer-kind"],
        attributes["csi.cert-manager.io/issuer-group"],
    ) == ("kuberl-ca", "ClusterIssuer", "cert-manager.io")
    # The key is readable by the pods' group (they do not run as root).
    assert attributes["csi.cert-manager.io/fs-group"] == "10001"


def test_without_roles_no_certificate_is_made_and_the_shared_secret_is_mounted() -> None:
    rendered = render("mutual-tls")
    assert rendered.all("Certificate") == []
    volumes = [_tls_volume(d) for d in workloads(rendered)]
    assert {v["secret"]["secretName"] for v in volumes if v} == {"kuberl-grpc-tls"}


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        ({"roles": {"enabled": True}, **ISSUER}, "it needs mutual TLS, set tls.enabled: true"),
        (
            {**ROLES_ON, **ISSUER, "secretName": "s", "requireClientCert": False},
            "tls.requireClientCert: true",
        ),
        (ROLES_ON, "tls.roles.enabled needs tls.certManager.issuerRef.name"),
        (
            {**ROLES_ON, "componentSecrets": {"buffer": "b", "trainer": "t"}},
            "not the rollout's",
        ),
    ],
)
def test_roles_without_what_they_need_fail_with_the_fix(tls: dict[str, Any], message: str) -> None:
    with pytest.raises(Exception, match=message):
        render_values({"tls": tls})
