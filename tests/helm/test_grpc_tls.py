"""gRPC TLS in the chart (`tls.enabled`): the job file's `tls` section, the certificate Secret in
every kuberl pod, and probes that speak TLS — the rendered probe command run for real against a
reward service serving mutual TLS with certificates the test makes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.chart import FULLNAME, pod_spec, render, render_values, workloads
from tests.integration.test_reward_service import reward_job
from tests.security.certs import authority
from tests.support import REPO, ServiceProcess

MOUNT = "/etc/kuberl-tls"
SERVER_NAME = f"{FULLNAME}-grpc"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _kuberl_containers(value_set: str) -> list[dict[str, Any]]:
    """Every container running the kuberl image's own code (not SGLang, not Redis)."""
    found = []
    for doc in workloads(render(value_set)):
        for c in pod_spec(doc)["containers"]:
            if c["name"] not in ("sglang", "redis"):
                found.append(c)
    return found


def _tls_env(container: dict[str, Any]) -> dict[str, str]:
    env = container.get("env", [])
    return {e["name"]: e["value"] for e in env if e["name"].startswith("KUBERL_TLS")}


def test_the_job_file_turns_on_mutual_tls_with_the_mounted_files() -> None:
    cm = render("mutual-tls").get("ConfigMap", "job")
    tls = yaml.safe_load(cm["data"]["job.yaml"])["tls"]
    assert tls == {
        "enabled": True,
        "ca_file": f"{MOUNT}/ca.crt",
        "cert_file": f"{MOUNT}/tls.crt",
        "key_file": f"{MOUNT}/tls.key",
        "require_client_cert": True,
        "server_name_override": SERVER_NAME,
    }


def test_every_kuberl_container_mounts_the_secret_and_has_the_tls_environment() -> None:
    rendered = render("mutual-tls")
    containers = _kuberl_containers("mutual-tls")
    assert {c["name"] for c in containers} >= {
        "buffer",
        "reward",
        "weight-sync",
        "rollout",
        "trainer",
        "health",
    }
    for doc in workloads(rendered):
        spec = pod_spec(doc)
        if not any(c in spec["containers"] for c in containers):
            continue
        volume = next(v for v in spec["volumes"] if v["name"] == "grpc-tls")
        assert volume["secret"] == {"secretName": "kuberl-grpc-tls", "defaultMode": 0o440}
    for c in containers:
        mount = next(m for m in c["volumeMounts"] if m["name"] == "grpc-tls")
        assert (mount["mountPath"], mount["readOnly"]) == (MOUNT, True), c["name"]
        assert _tls_env(c)["KUBERL_TLS__SERVER_NAME_OVERRIDE"] == SERVER_NAME, c["name"]


def test_without_tls_nothing_of_it_is_rendered() -> None:
    for c in _kuberl_containers("defaults"):
        assert _tls_env(c) == {}
        assert all(m["name"] != "grpc-tls" for m in c.get("volumeMounts", []))
    assert "tls" not in yaml.safe_load(
        render("defaults").get("ConfigMap", "job")["data"]["job.yaml"]
    )


def test_with_tls_probes_run_kuberl_health_instead_of_the_plaintext_grpc_probe() -> None:
    probed = 0
    for c in _kuberl_containers("mutual-tls"):
        for name in PROBES:
            if name not in c:
                continue
            probed += 1
            assert "grpc" not in c[name]
            command = c[name]["exec"]["command"]
            assert command[:3] == ["kuberl", "health", "--timeout"]
            assert command[-1].startswith("127.0.0.1:")
    assert probed >= 3 * 5  # three probes on buffer, reward, weight-sync, rollout, trainer


def test_tls_without_a_secret_fails_with_a_clear_message() -> None:
    with pytest.raises(Exception, match="tls.enabled needs tls.secretName"):
        render_values({"tls": {"enabled": True}})


def test_the_rendered_probe_reports_serving_over_mutual_tls_and_plaintext_would_not(
    tmp_path: Path,
) -> None:
    # The Secret's files, from a CA of the test's making, with the name the chart expects.
    ca = authority(tmp_path / "pki")
    leaf = ca.issue("kuberl", dns=(SERVER_NAME,), ips=())
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "ca.crt").write_bytes(ca.cert.read_bytes())
    (secret / "tls.crt").write_bytes(leaf.cert.read_bytes())
    (secret / "tls.key").write_bytes(leaf.key.read_bytes())

    reward = next(c for c in _kuberl_containers("mutual-tls") if c["name"] == "reward")
    env = {k: v.replace(MOUNT, str(secret)) for k, v in _tls_env(reward).items()}
    probe = reward["readinessProbe"]["exec"]["command"]
    with ServiceProcess.kuberl("reward", reward_job(tmp_path), tmp_path, env=env) as proc:
        proc.wait_listening(timeout=120)
        command = [sys.executable, "-m", "kuberl.cli", *probe[1:-1], proc.address]
        command[command.index("--timeout") + 1] = "60"
        with_tls = subprocess.run(
            command, env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, cwd=REPO
        )
        command[command.index("--timeout") + 1] = "2"
        plaintext = subprocess.run(
            command, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, cwd=REPO
        )
    assert (with_tls.returncode, with_tls.stdout.split()[-1]) == (0, "SERVING"), with_tls.stderr
    assert (plaintext.returncode, plaintext.stdout.split()[-1]) == (1, "UNAVAILABLE")
