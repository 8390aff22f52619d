"""What the rendered chart does: the job file it hands the services (accepted by their own loader),
pod restarts on job changes, Redis or external Redis, rollout with SGLang and its autoscalers,
the multi-node trainer, security settings, probes, disruption budgets and dashboards."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import yaml

from kuberl.common.config import parse_job_config
from tests.helm.chart import (
    CHART,
    FULLNAME,
    NAMESPACE,
    VALUE_SETS,
    pod_spec,
    render,
    render_values,
    workloads,
)

GRPC_COMPONENTS = {"buffer": 50051, "reward": 50052, "weight-sync": 50053, "rollout": 50060}


def _job(value_set: str, **overrides: Any) -> dict[str, Any]:
    cm = render(value_set, **overrides).get("ConfigMap", "job")
    job: dict[str, Any] = yaml.safe_load(cm["data"]["job.yaml"])
    return job


def _container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod_spec(doc)["containers"] if c["name"] == name)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_the_rendered_job_file_is_accepted_by_the_services_own_loader(value_set: str) -> None:
    parse_job_config(_job(value_set), env={}, source=f"job ConfigMap ({value_set})")


@pytest.mark.parametrize("value_set", ["defaults", "multi-node-trainer"])
def test_each_container_accepts_the_job_with_its_env_overrides(value_set: str) -> None:
    downward = {"$(POD_IP)": "10.1.2.3", "$(POD_NAME)": "rl-kuberl-rollout-7d9f-x2x4q"}
    overridden = {}
    for doc in workloads(render(value_set)):
        for c in pod_spec(doc)["containers"]:
            env = {
                name: downward.get(value, value)
                for name, value in _env(c).items()
                if name.startswith("KUBERL_") and "__" in name and isinstance(value, str)
            }
            if env:
                config = parse_job_config(_job(value_set), env=env, source=c["name"])
                overridden[c["name"]] = config
    assert overridden["weight-sync"].weight_sync.advertise_host == "10.1.2.3"
    assert overridden["rollout"].rollout.replica_id == downward["$(POD_NAME)"]


def test_endpoints_in_the_job_name_the_services_the_chart_creates() -> None:
    rendered, job = render("defaults"), _job("defaults")
    services = {
        s["metadata"]["name"]: {p["port"] for p in s["spec"]["ports"]}
        for s in rendered.all("Service")
    }
    resolved = {}
    for name, endpoint in job["endpoints"].items():
        host, port = endpoint.rsplit(":", 1)
        # trainer rank 0 is reached as <pod>.<headless service>.<namespace>.svc
        service = host.split(".")[1] if name == "trainer" else host
        resolved[name] = int(port) in services[service]
    assert resolved == {"buffer": True, "reward": True, "weight_sync": True, "trainer": True}


def test_chart_wiring_overrides_the_job_and_keeps_the_rest() -> None:
    job = _job(
        "defaults",
        job={
            "endpoints": {"buffer": "elsewhere:1"},
            "buffer": {"max_inflight_groups": 7, "server": {"port": 1}},
        },
    )
    assert (job["endpoints"]["buffer"], job["buffer"]["max_inflight_groups"]) == (
        f"{FULLNAME}-buffer:50051",
        7,
    )
    assert job["buffer"]["server"] == {"host": "0.0.0.0", "port": 50051, "metrics_port": 9101}


def test_every_kuberl_pod_restarts_when_the_job_changes() -> None:
    def checksums(rendered):
        return {
            d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"]["checksum/job"]
            for d in rendered.docs
            if d["kind"] in ("Deployment", "StatefulSet")
            and not d["metadata"]["name"].endswith("redis")
        }

    before = checksums(render("defaults"))
    after = checksums(render("defaults", job={"trainer": {"total_steps": 7}}))
    text = render("defaults").get("ConfigMap", "job")["data"]["job.yaml"]
    digest = hashlib.sha256(text.removesuffix("\n").encode()).hexdigest()
    assert set(before.values()) == {digest}
    assert len(before) == 5 and all(after[name] != before[name] for name in before)


def test_builtin_redis_keeps_an_aof_on_a_volume_and_its_password_in_a_secret() -> None:
    rendered = render("defaults")
    redis = rendered.get("StatefulSet", "redis")
    conf = rendered.get("ConfigMap", "redis")["data"]["redis.conf"]
    container = _container(redis, "redis")
    assert "appendonly yes" in conf and "appendfsync everysec" in conf
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert _env(container)["REDIS_PASSWORD"] == {
        "secretKeyRef": {"name": f"{FULLNAME}-redis", "key": "redis-password"}
    }
    assert rendered.get("Secret", "redis")["metadata"]["annotations"] == {
        "helm.sh/resource-policy": "keep"
    }


def test_no_secret_value_appears_in_a_command_line() -> None:
    for value_set in VALUE_SETS:
        for doc in workloads(render(value_set)):
            for c in pod_spec(doc)["containers"]:
                line = json.dumps(c.get("command", []) + c.get("args", []))
                assert "secretKeyRef" not in line and "password=" not in line.lower()


def test_external_redis_replaces_the_statefulset_with_a_tls_url_and_its_secret() -> None:
    rendered = render("external-redis")
    buffer = _container(rendered.get("Deployment", "buffer"), "buffer")
    env = _env(buffer)
    assert not rendered.has("StatefulSet", "redis")
    assert _job("external-redis")["redis"]["url"] == "rediss://redis.storage.svc:6380/2"
    assert env["REDIS_PASSWORD"] == {"secretKeyRef": {"name": "redis-auth", "key": "password"}}
    assert env["SSL_CERT_FILE"] == "/etc/kuberl/redis-ca/ca.crt"


def test_external_redis_without_a_host_fails_with_a_clear_message() -> None:
    from helm_python import HelmRenderError

    with pytest.raises(HelmRenderError, match="externalRedis.host is required"):
        render_values({"redis": {"enabled": False}})


def test_rollout_pods_pair_an_sglang_server_with_the_kuberl_worker() -> None:
    rendered = render("multi-node-trainer")
    rollout = rendered.get("Deployment", "rollout")
    sglang = _container(rollout, "sglang")
    args = sglang["args"]
    engine = _job("multi-node-trainer")["rollout"]["engine"]
    assert rollout["spec"]["replicas"] == 3
    assert args[args.index("--model-path") + 1] == "/models/Qwen2.5-7B"
    assert args[args.index("--tp-size") + 1] == "2"
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert engine == {
        "kind": "sglang",
        "url": "http://127.0.0.1:30000",
        "launch": False,
        "tp_size": 2,
        "mem_fraction_static": 0.85,
        "snapshot_dir": "/var/lib/kuberl/sglang-weights",
    }


def test_both_rollout_containers_mount_the_folder_sglang_loads_snapshots_from() -> None:
    # The rollout container writes a version that did not come by NCCL there and sends SGLang
    # that path (/update_weights_from_disk): it must name the same files in both containers.
    rollout = render("defaults").get("Deployment", "rollout")
    folder = _job("defaults")["rollout"]["engine"]["snapshot_dir"]
    volumes = {v["name"]: v for v in pod_spec(rollout)["volumes"]}
    mounts = {
        name: {m["mountPath"]: m for m in _container(rollout, name)["volumeMounts"]}
        for name in ("sglang", "rollout")
    }
    writer, reader = mounts["rollout"].get(folder, {}), mounts["sglang"].get(folder, {})
    assert folder.startswith("/")
    assert (writer.get("name"), writer.get("readOnly", False)) == ("sglang-weights", False)
    assert (reader.get("name"), reader.get("readOnly")) == ("sglang-weights", True)
    assert volumes["sglang-weights"]["emptyDir"] == {"sizeLimit": "64Gi"}


def test_with_sglang_weight_sync_relays_over_nccl_from_a_gpu_with_sglangs_nccl() -> None:
    rendered = render("defaults", rollout={"tolerations": [{"key": "gpu", "operator": "Exists"}]})
    job = _job("defaults")
    weight_sync = rendered.get("Deployment", "weight-sync")
    container = _container(weight_sync, "weight-sync")
    config = parse_job_config(job, env={}, source="job ConfigMap")
    assert (config.weight_sync.device, "nccl" in config.weight_sync.transports) == ("cuda", True)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The rollout image: SGLang's PyTorch and NCCL at both ends of the group.
    sglang = _container(rendered.get("Deployment", "rollout"), "sglang")
    assert container["image"] == sglang["image"]
    assert pod_spec(weight_sync)["tolerations"] == [{"key": "gpu", "operator": "Exists"}]


@pytest.mark.parametrize(
    ("value_set", "overrides"),
    [
        ("cpu-only", {}),
        ("defaults", {"job": {"weight_sync": {"device": "cpu"}}}),
        ("defaults", {"job": {"weight_sync": {"transports": ["gloo", "snapshot"]}}}),
    ],
    ids=["without-sglang", "job-says-cpu", "no-nccl-in-transports"],
)
def test_weight_sync_has_no_gpu_when_it_would_send_no_nccl(value_set: str, overrides) -> None:
    rendered = render(value_set, **overrides)
    container = _container(rendered.get("Deployment", "weight-sync"), "weight-sync")
    device = _job(value_set, **overrides)["weight_sync"].get("device", "cpu")
    limits = container["resources"].get("limits", {})
    slim = _container(rendered.get("Deployment", "buffer"), "buffer")["image"]
    assert (device, "nvidia.com/gpu" in limits, container["image"]) == ("cpu", False, slim)


def test_without_sglang_the_rollout_keeps_the_jobs_own_engine() -> None:
    rollout = render("cpu-only").get("Deployment", "rollout")
    names = [c["name"] for c in pod_spec(rollout)["containers"]]
    assert (names, _job("cpu-only")["rollout"]["engine"]) == (
        ["rollout"],
        {"kind": "torch", "device": "cpu"},
    )


def test_hpa_autoscaling_owns_the_rollout_replicas() -> None:
    rendered = render("autoscaling-hpa")
    hpa = rendered.get("HorizontalPodAutoscaler", "rollout")
    metric = hpa["spec"]["metrics"][0]["external"]
    assert "replicas" not in rendered.get("Deployment", "rollout")["spec"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 12)
    assert metric["metric"]["selector"]["matchLabels"] == {"namespace": NAMESPACE}
    assert metric["target"] == {"type": "AverageValue", "averageValue": "16"}


def test_keda_autoscaling_queries_the_buffer_backlog_of_this_namespace() -> None:
    rendered = render("autoscaling-keda", job={"buffer": {"max_inflight_groups": 96}})
    scaled = rendered.get("ScaledObject", "rollout")
    trigger = scaled["spec"]["triggers"][0]
    assert "replicas" not in rendered.get("Deployment", "rollout")["spec"]
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (0, 6)
    assert trigger["metadata"]["query"] == (
        'clamp_min(96 - sum(max by (kind) (kuberl_buffer_groups_pending{kind=~"train|sft",'
        f'namespace="{NAMESPACE}"}})) - sum(max by (kind) (kuberl_buffer_groups_in_batches'
        f'{{kind=~"train|sft",namespace="{NAMESPACE}"}})), 0)'
    )


def test_autoscaling_with_min_above_max_fails() -> None:
    from helm_python import HelmRenderError

    with pytest.raises(HelmRenderError, match="must not exceed maxReplicas"):
        render_values(
            {"rollout": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}}
        )


def test_multi_node_trainer_runs_torchrun_across_statefulset_pods() -> None:
    rendered = render("multi-node-trainer")
    master, workers = (
        rendered.get("StatefulSet", "trainer"),
        rendered.get("StatefulSet", "trainer-worker"),
    )
    master_c, worker_c = _container(master, "trainer"), _container(workers, "trainer")
    headless = rendered.get("Service", "trainer-headless")
    rendezvous = [
        "--nnodes=4",
        "--nproc-per-node=8",
        f"--master-addr={FULLNAME}-trainer-0.{FULLNAME}-trainer-headless.{NAMESPACE}.svc",
        "--master-port=29500",
    ]
    assert (master["spec"]["replicas"], workers["spec"]["replicas"]) == (1, 3)
    assert master_c["command"] == ["torchrun"] and master_c["args"][:5] == [
        "--node-rank=0",
        *rendezvous,
    ]
    assert worker_c["args"][:4] == rendezvous and "--node-rank" in worker_c["command"][2]
    assert {c["resources"]["limits"]["nvidia.com/gpu"] for c in (master_c, worker_c)} == {8}
    assert (headless["spec"]["clusterIP"], headless["spec"]["publishNotReadyAddresses"]) == (
        "None",
        True,
    )
    assert rendered.get("PersistentVolumeClaim", "checkpoints-rwx-nfs")["spec"]["accessModes"] == [
        "ReadWriteMany"
    ]
    assert "NCCL_SOCKET_IFNAME" in _env(worker_c)


def test_only_the_rank_0_pod_is_probed_and_scraped() -> None:
    rendered = render("multi-node-trainer")
    master, workers = (
        _container(rendered.get("StatefulSet", name), "trainer")
        for name in ("trainer", "trainer-worker")
    )
    # Ranks other than 0 bind no port (kuberl.trainer.server): a gRPC probe would kill them.
    assert "readinessProbe" in master and "readinessProbe" not in workers
    assert [p["name"] for p in master["ports"]] == ["grpc", "metrics", "rendezvous"]
    assert "ports" not in workers


@pytest.mark.parametrize(("pod_index", "node_rank"), [(0, 1), (2, 3)])
def test_a_worker_pod_computes_its_node_rank_from_its_index(tmp_path, pod_index, node_rank) -> None:
    import os
    import re
    import subprocess

    worker = _container(
        render("multi-node-trainer").get("StatefulSet", "trainer-worker"), "trainer"
    )
    fake = tmp_path / "torchrun"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "POD_INDEX": str(pod_index)}

    def kubelet(text: str) -> str:  # the kubelet's $(VAR) expansion, `$$` escaping a `$`
        return re.sub(
            r"\$\$|\$\((\w+)\)",
            lambda m: env.get(m.group(1) or "", m.group(0)) if m.group(1) else "$",
            text,
        )

    argv = [kubelet(a) for a in worker["command"] + worker["args"]]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout
    assert out.splitlines()[:2] == [f"--node-rank={node_rank}", "--nnodes=4"]


def test_multi_node_trainer_refuses_a_checkpoint_volume_only_one_node_can_write() -> None:
    from helm_python import HelmRenderError

    with pytest.raises(HelmRenderError, match="ReadWriteMany"):
        render_values({"trainer": {"nodes": 2}})


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_container_runs_unprivileged_on_a_read_only_root(value_set: str) -> None:
    offenders = []
    for doc in workloads(render(value_set)):
        spec = pod_spec(doc)
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c.get("securityContext", {})
            ok = (
                sc.get("runAsNonRoot") is True
                and sc.get("readOnlyRootFilesystem") is True
                and sc.get("allowPrivilegeEscalation") is False
                and sc.get("capabilities", {}).get("drop") == ["ALL"]
                and spec["securityContext"].get("runAsUser", 0) != 0
                and spec["automountServiceAccountToken"] is False
            )
            if not ok:
                offenders.append(f"{doc['metadata']['name']}/{c['name']}")
    assert offenders == []


def test_the_service_account_has_no_api_rights() -> None:
    kinds = {d["kind"] for value_set in VALUE_SETS for d in render(value_set).docs}
    sa = render("defaults").get("ServiceAccount", "")
    assert kinds.isdisjoint({"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"})
    assert sa["automountServiceAccountToken"] is False


def test_grpc_services_are_probed_with_grpc_health_on_their_port() -> None:
    rendered = render("defaults")
    probes = {}
    for component, port in {**GRPC_COMPONENTS, "trainer": 50054}.items():
        kind = "StatefulSet" if component == "trainer" else "Deployment"
        container = _container(rendered.get(kind, component), component)
        probes[component] = {
            name: container[name]["grpc"]["port"]
            for name in ("startupProbe", "readinessProbe", "livenessProbe")
        }
        assert set(probes[component].values()) == {port}, component


def test_every_component_has_a_disruption_budget_stateful_ones_hold_drains() -> None:
    rendered = render("defaults")
    budgets = {
        d["metadata"]["name"]: d["spec"]["maxUnavailable"]
        for d in rendered.all("PodDisruptionBudget")
    }
    stateful = {f"{FULLNAME}-trainer": 0, f"{FULLNAME}-redis": 0}
    assert budgets == {f"{FULLNAME}-{c}": 1 for c in GRPC_COMPONENTS} | stateful


def test_weight_sync_is_a_single_replica_replaced_not_rolled() -> None:
    ws = render("defaults").get("Deployment", "weight-sync")
    assert (ws["spec"]["replicas"], ws["spec"]["strategy"]["type"]) == (1, "Recreate")


def test_each_dashboard_file_becomes_a_labelled_configmap() -> None:
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    maps = render("monitoring").all("ConfigMap")
    dashboards = {
        key: m["metadata"]["annotations"]
        for m in maps
        if m["metadata"]["labels"].get("grafana_dashboard") == "1"
        for key in m["data"]
    }
    assert files and sorted(dashboards) == [f"kuberl-{name}" for name in files]
    assert set(map(json.dumps, dashboards.values())) == {'{"grafana_folder": "kuberl"}'}
    assert not any("grafana_dashboard" in d["metadata"]["labels"] for d in render("cpu-only").docs)


def test_notes_tell_the_user_what_is_missing_and_what_to_run_next() -> None:
    notes = render("defaults").notes
    ready = render("multi-node-trainer").notes
    assert "job.data.train is empty" in notes and "helm test rl" in notes
    assert "job.data.train is empty" not in ready and "4 node(s) x 8 GPU(s)" in ready


@pytest.mark.parametrize("value_set", ["defaults", "multi-node-trainer", "cpu-only"])
def test_kuberl_containers_work_in_a_writable_directory(value_set: str) -> None:
    # Relative paths of the job (a locally built model's cache, run folders) must not hit the
    # read-only root filesystem.
    unwritable = []
    for doc in workloads(render(value_set)):
        for c in pod_spec(doc)["containers"]:
            if c["name"] in ("sglang", "redis") or doc["kind"] == "Pod":
                continue
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            mount = mounts.get(c.get("workingDir", "/"))
            if mount is None or mount.get("readOnly"):
                unwritable.append(f"{doc['metadata']['name']}/{c['name']}")
    assert unwritable == []


def test_the_rollout_worker_may_wait_as_long_as_sglang_takes_to_load() -> None:
    rollout = render("defaults").get("Deployment", "rollout")

    def startup_seconds(name: str) -> int:
        probe = _container(rollout, name)["startupProbe"]
        return int(probe["periodSeconds"] * probe["failureThreshold"])

    # The worker reports SERVING only after its engine (SGLang) is up and has the current weights.
    assert startup_seconds("rollout") > startup_seconds("sglang") == 1800


def test_the_trainer_may_take_its_startup_seconds_to_rendezvous_and_load() -> None:
    # Rank 0 binds its gRPC port only after torchrun's rendezvous (every node's pod scheduled,
    # its image pulled), then waits for the buffer, loads the model and builds DeepSpeed. With
    # the global 300 s startup budget the kubelet restarted it in a loop.
    def startup_seconds(**overrides: Any) -> int:
        master = render("multi-node-trainer", **overrides).get("StatefulSet", "trainer")
        probe = _container(master, "trainer")["startupProbe"]
        return int(probe["periodSeconds"] * probe["failureThreshold"])

    assert startup_seconds() == 3600
    assert startup_seconds(trainer={"startupSeconds": 7200}) == 7200


def test_torch_compile_caches_go_to_the_trainers_cache_volume() -> None:
    trainer = _container(render("defaults").get("StatefulSet", "trainer"), "trainer")
    env = _env(trainer)
    mounted = {m["mountPath"] for m in trainer["volumeMounts"]}
    caches = [env[name] for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")]
    assert all(c.startswith("/var/cache/kuberl/") for c in caches)
    assert "/var/cache/kuberl" in mounted


def test_every_statefulset_name_leaves_room_for_its_pods_revision_label() -> None:
    # The controller-revision-hash label (63 characters at most) is the StatefulSet's name, a
    # dash and a 10-character hash: a longer name and its pods are never created. A 36-character
    # release made the worker StatefulSet 55 characters.
    values = render_values(
        VALUE_SETS["multi-node-trainer"], release="gsm8k-qwen25-7b-grpo-experiment-0042"
    )
    names = {d["metadata"]["name"] for d in values.all("StatefulSet")}
    assert len(names) == 3 and {n for n in names if len(n) > 52} == set()


def test_sglang_without_the_policys_weights_in_model_path_fails_with_a_clear_message() -> None:
    from helm_python import HelmRenderError

    # SGLang would serve Qwen while the trainer and the rollout worker built a tiny random model.
    values = {"model": {"path": ""}, "rollout": {"sglang": {"model": "Qwen/Qwen2.5-7B-Instruct"}}}
    with pytest.raises(HelmRenderError, match="needs the policy's weights in model.path"):
        render_values(values)
    job_path = {**values, "job": {"model": {"path": "/models/qwen"}}}
    assert render_values(job_path).get("Deployment", "rollout")


def test_scraping_pods_and_services_both_is_refused_as_double_counting() -> None:
    from helm_python import HelmRenderError

    both = {"metrics": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}}
    with pytest.raises(HelmRenderError, match="scrape every kuberl pod twice"):
        render_values(both)
    assert render("monitoring-pods").all("PodMonitor")


@pytest.mark.parametrize(("drain", "sleep"), [(None, 45), (60, 75)])
def test_sglang_outlives_the_rollout_workers_drain(drain: int | None, sleep: int) -> None:
    # Both containers get SIGTERM at once; the worker's drain lets in-flight prompts finish on
    # SGLang, which must still be up: it is signalled drain_seconds + 15 s later.
    job = {} if drain is None else {"job": {"rollout": {"drain_seconds": drain}}}
    rollout = render("defaults", **job).get("Deployment", "rollout")
    pre_stop = _container(rollout, "sglang")["lifecycle"]["preStop"]["exec"]["command"]
    grace = pod_spec(rollout)["terminationGracePeriodSeconds"]
    assert (pre_stop, sleep < grace) == (["sleep", str(sleep)], True)


def test_torchrun_gives_its_workers_most_of_the_pods_grace_period_to_stop() -> None:
    # torchrun SIGKILLs its workers 30 s after forwarding SIGTERM unless told otherwise, where
    # the pod's 300 s were meant for finishing a step and writing the last checkpoint.
    for name in ("trainer", "trainer-worker"):
        rendered = render("multi-node-trainer").get("StatefulSet", name)
        env = _env(_container(rendered, "trainer"))
        grace = pod_spec(rendered)["terminationGracePeriodSeconds"]
        assert (env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"], grace) == ("270", 300)
