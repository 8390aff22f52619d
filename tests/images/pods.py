"""Run the pods a `helm template` of the chart renders, from locally built images, without a
cluster: the harness of `make image-test` (tests/images/test_chart_pods.py).

Each rendered workload (Deployment, StatefulSet: one pod each) becomes a *pod*: its own network
namespace with an `eth0` on a private bridge and its own address, an /etc/hosts in which every
Service name the chart renders resolves to the address of the pod its selector picks (headless
Services: `<pod>.<service>`), and its main container started by tests/images/launcher.py from the
image's root filesystem (one `buildah from` + `buildah mount` per image, shared read-only by every
pod of that image) with the rendered command, args, env (Secret and field references resolved,
`$(VAR)` expanded as the kubelet does), working directory, user, groups and volumes: ConfigMaps
and Secrets as files, emptyDirs as fresh folders (tmpfs for `medium: Memory`), and persistent
volume claims as host folders the test provides. Probes are answered as the kubelet would:
gRPC health checks and TCP connects against the pod's address, exec probes inside the running
container. What is not modelled: scheduling, resources and limits, restarts, Service load
balancing over several pods, network policies, GPUs.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAUNCHER = Path(__file__).with_name("launcher.py")
BRIDGE = "krl-br0"
SUBNET = ipaddress.ip_network("10.213.0.0/24")
GATEWAY = str(SUBNET.network_address + 1)
CLUSTER_DOMAIN = "cluster.local"
# The working containers whose root filesystems the pods run from (one per image).
CONTAINER_PREFIX = "krl-pods-"


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


def _buildah(*args: str) -> str:
    return _run("buildah", "--storage-driver", "vfs", *args).stdout.strip()


class Network:
    """A bridge on the host and one network namespace per pod, each with an `eth0` on it."""

    def __init__(self) -> None:
        self.namespaces: list[str] = []
        self._next = 2
        self.teardown()
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{GATEWAY}/{SUBNET.prefixlen}", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")

    def add(self, pod: str) -> str:
        """A namespace for this pod; returns its address."""
        address = str(SUBNET.network_address + self._next)
        index = self._next
        self._next += 1
        namespace = f"krl-{index}"
        host_end = f"krl-veth{index}"
        _run("ip", "netns", "add", namespace)
        self.namespaces.append(namespace)
        _run(
            "ip",
            "link",
            "add",
            host_end,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            namespace,
        )
        _run("ip", "link", "set", host_end, "master", BRIDGE, "up")
        inside = ("ip", "netns", "exec", namespace, "ip")
        _run(*inside, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0")
        _run(*inside, "link", "set", "eth0", "up")
        _run(*inside, "link", "set", "lo", "up")
        _run(*inside, "route", "add", "default", "via", GATEWAY)
        return address

    def namespace_of(self, address: str) -> str:
        return f"krl-{int(ipaddress.ip_address(address)) - int(SUBNET.network_address)}"

    def teardown(self) -> None:
        listed = _run("ip", "netns", "list", check=False).stdout
        for line in listed.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith("krl-"):
                _run("ip", "netns", "delete", name, check=False)
        _run("ip", "link", "delete", BRIDGE, check=False)


@dataclass
class ImageRoot:
    """One image's root filesystem, mounted once on the host (a buildah working container)."""

    ref: str
    container: str
    path: Path
    config: dict[str, Any]

    @classmethod
    def mount(cls, ref: str) -> ImageRoot:
        """Mount the image's working container, made on first use and kept for the next run
        (with vfs storage `buildah from` copies the whole image: a minute per image here);
        tests/images/build.py removes it with its image."""
        container = CONTAINER_PREFIX + re.sub(r"[^a-zA-Z0-9_.-]", "-", ref.split("/")[-1])
        listed = _run("buildah", "--storage-driver", "vfs", "inspect", container, check=False)
        if listed.returncode != 0:
            _buildah("from", "--pull-never", "--name", container, ref)
        path = Path(_buildah("mount", container))
        inspected = json.loads(_buildah("inspect", "--type", "image", ref))
        config = inspected.get("OCIv1", {}).get("config", {})
        # What a runtime creates in a container's writable layer before mounting over it.
        for name in ("hosts", "hostname", "resolv.conf"):
            (path / "etc" / name).touch()
        for name in ("proc", "dev", "sys"):
            (path / name).mkdir(exist_ok=True)
        return cls(ref, container, path, config)

    def unmount(self) -> None:
        _run("buildah", "--storage-driver", "vfs", "umount", self.container, check=False)


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _quantity_bytes(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: a defined variable is replaced, `$$` escapes, an
    undefined reference stays as written."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, text)


@dataclass
class Probe:
    """A rendered probe and the results of asking it."""

    kind: str
    spec: dict[str, Any]
    results: list[tuple[float, bool, str]] = field(default_factory=list)


@dataclass
class Pod:
    """One pod of a rendered workload and its main container."""

    name: str
    workload: dict[str, Any]
    address: str
    hostname: str
    subdomain: str | None
    labels: dict[str, str]
    spec: dict[str, Any]
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    probes: dict[str, Probe] = field(default_factory=dict)
    log_path: Path | None = None

    @property
    def container(self) -> dict[str, Any]:
        main: dict[str, Any] = self.spec["containers"][0]
        return main


class Cluster:
    """The rendered chart's pods, run from local images: `start()` them, `wait_ready()`, then
    `stop()`; `exit_code(pod)` for a pod whose process ended (the trainer at the end of its job)."""

    def __init__(
        self,
        docs: list[dict[str, Any]],
        namespace: str,
        claims: dict[str, Path],
        workdir: Path,
        components: list[str],
    ) -> None:
        self.docs = docs
        self.namespace = namespace
        self.claims = claims
        self.workdir = workdir
        self.objects = {(d["kind"], d["metadata"]["name"]): d for d in docs}
        self.images: dict[str, ImageRoot] = {}
        self.network = Network()
        self.pods: dict[str, Pod] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        for doc in docs:
            component = doc["metadata"].get("labels", {}).get("app.kubernetes.io/component")
            if doc["kind"] in ("Deployment", "StatefulSet") and component in components:
                pod = self._pod(doc)
                self.pods[component] = pod

    # -- building the pods -------------------------------------------------------------------

    def _pod(self, doc: dict[str, Any]) -> Pod:
        """The one pod of a workload (Deployment, StatefulSet) or a bare Pod."""
        name = doc["metadata"]["name"]
        if doc["kind"] == "Pod":
            labels = dict(doc["metadata"].get("labels", {}))
            pod_name, spec, subdomain = name, doc["spec"], None
        else:
            template = doc["spec"]["template"]
            labels = dict(template["metadata"].get("labels", {}))
            spec, subdomain = template["spec"], None
            if doc["kind"] == "StatefulSet":
                pod_name = f"{name}-0"
                labels["apps.kubernetes.io/pod-index"] = "0"
                labels["statefulset.kubernetes.io/pod-name"] = pod_name
                subdomain = doc["spec"]["serviceName"]
            else:
                pod_name = f"{name}-7f9c8d6b5-x2k4q"
        address = self.network.add(pod_name)
        workdir = self.workdir / pod_name
        (workdir / "root").mkdir(parents=True)
        return Pod(pod_name, doc, address, pod_name, subdomain, labels, spec, workdir)

    def _hosts(self, pod: Pod) -> str:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        own = [pod.hostname]
        if pod.subdomain:
            fqdn = f"{pod.hostname}.{pod.subdomain}.{self.namespace}.svc.{CLUSTER_DOMAIN}"
            own.insert(0, fqdn)
        lines.append(f"{pod.address}\t{' '.join(own)}")
        for doc in self.docs:
            if doc["kind"] != "Service":
                continue
            service = doc["metadata"]["name"]
            selector = doc["spec"].get("selector") or {}
            targets = [p for p in self.pods.values() if _selects(selector, p.labels)]
            headless = doc["spec"].get("clusterIP") == "None"
            for target in targets:
                if headless and target.subdomain == service:
                    base = f"{target.hostname}.{service}"
                elif not headless and len(targets) == 1:
                    base = service
                else:
                    continue
                names = [base, f"{base}.{self.namespace}", f"{base}.{self.namespace}.svc"]
                names.append(f"{base}.{self.namespace}.svc.{CLUSTER_DOMAIN}")
                lines.append(f"{target.address}\t{' '.join(names)}")
        return "\n".join(lines) + "\n"

    def secret_value(self, name: str, key: str) -> str:
        data = self.objects[("Secret", name)].get("data", {})
        return base64.b64decode(data[key]).decode()

    def _config_map(self, name: str) -> dict[str, str]:
        data: dict[str, str] = self.objects[("ConfigMap", name)].get("data", {})
        return data

    def _field(self, pod: Pod, path: str) -> str:
        fields = {
            "metadata.name": pod.name,
            "metadata.namespace": self.namespace,
            "status.podIP": pod.address,
            "spec.nodeName": "image-test",
            "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default"),
        }
        label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
        if label:
            return pod.labels[label.group(1)]
        if path not in fields:
            raise ValueError(f"{pod.name}: fieldRef {path} is not modelled by tests/images/pods.py")
        return fields[path]

    def _env(self, pod: Pod, container: dict[str, Any], image_env: list[str]) -> dict[str, str]:
        env = dict(item.split("=", 1) for item in image_env)
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                data = self.objects[("Secret", source["secretRef"]["name"])].get("data", {})
                env.update({k: base64.b64decode(v).decode() for k, v in data.items()})
            if "configMapRef" in source:
                env.update(self._config_map(source["configMapRef"]["name"]))
        defined: dict[str, str] = {}
        for item in container.get("env", []):
            if "value" in item:
                value = expand(str(item["value"]), defined)
            else:
                ref = item["valueFrom"]
                if "secretKeyRef" in ref:
                    value = self.secret_value(
                        ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"]
                    )
                elif "configMapKeyRef" in ref:
                    cm = ref["configMapKeyRef"]
                    value = self._config_map(cm["name"])[cm["key"]]
                elif "fieldRef" in ref:
                    value = self._field(pod, ref["fieldRef"]["fieldPath"])
                else:
                    raise ValueError(f"{pod.name}: env {item['name']}: {ref} is not modelled")
            defined[item["name"]] = value
        env.update(defined)
        env.setdefault("HOSTNAME", pod.hostname)
        return env

    def _volume_source(
        self, pod: Pod, volume: dict[str, Any], fs_group: int | None
    ) -> dict[str, Any]:
        """Where a pod volume lives on the host: a folder, or a tmpfs size."""
        folder = pod.workdir / "volumes" / volume["name"]
        if "emptyDir" in volume:
            empty = volume["emptyDir"] or {}
            if empty.get("medium") == "Memory":
                return {"tmpfs": _quantity_bytes(str(empty.get("sizeLimit", "64Mi")))}
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o777)
            return {"source": str(folder)}
        if "configMap" in volume or "secret" in volume:
            folder.mkdir(parents=True, exist_ok=True)
            if "configMap" in volume:
                data = self._config_map(volume["configMap"]["name"])
            else:
                secret = self.objects[("Secret", volume["secret"]["secretName"])].get("data", {})
                data = {k: base64.b64decode(v).decode() for k, v in secret.items()}
            for key, text in data.items():
                (folder / key).write_text(text)
                (folder / key).chmod(0o644)
            return {"source": str(folder)}
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if claim not in self.claims:
                raise ValueError(f"{pod.name}: volume {volume['name']}: claim {claim} not given")
            folder = self.claims[claim]
            if fs_group is not None:
                # The kubelet's fsGroup ownership change: group-owned, group-writable, setgid dirs.
                _run("chgrp", "-R", str(fs_group), str(folder))
                _run("chmod", "-R", "g+rwX", str(folder))
                _run("find", str(folder), "-type", "d", "-exec", "chmod", "g+s", "{}", "+")
            return {"source": str(folder)}
        raise ValueError(f"{pod.name}: volume {volume['name']}: {sorted(volume)} not modelled")

    def _claim_templates(self, pod: Pod) -> list[dict[str, Any]]:
        """A StatefulSet's volumeClaimTemplates as volumes: `<template>-<pod>` claims."""
        volumes = []
        for template in pod.workload["spec"].get("volumeClaimTemplates", []):
            claim = f"{template['metadata']['name']}-{pod.name}"
            if claim not in self.claims:
                folder = self.workdir / "claims" / claim
                folder.mkdir(parents=True)
                self.claims[claim] = folder
            volumes.append(
                {
                    "name": template["metadata"]["name"],
                    "persistentVolumeClaim": {"claimName": claim},
                }
            )
        return volumes

    def _launch_spec(self, pod: Pod, container: dict[str, Any], image: ImageRoot) -> dict[str, Any]:
        config = image.config
        pod_security = pod.spec.get("securityContext", {})
        security = container.get("securityContext", {})
        uid = security.get("runAsUser", pod_security.get("runAsUser"))
        gid = security.get("runAsGroup", pod_security.get("runAsGroup"))
        image_user = str(config.get("User") or "0").split(":")
        uid = int(image_user[0]) if uid is None else int(uid)
        gid = int(image_user[1] if len(image_user) > 1 else uid) if gid is None else int(gid)
        if security.get("runAsNonRoot", pod_security.get("runAsNonRoot")) and uid == 0:
            raise ValueError(f"{pod.name}: runAsNonRoot but the container would run as root")
        fs_group = pod_security.get("fsGroup")
        groups = sorted({gid, *([int(fs_group)] if fs_group is not None else [])})
        env = self._env(pod, container, config.get("Env") or [])
        volumes = {v["name"]: v for v in pod.spec.get("volumes", []) + self._claim_templates(pod)}
        mounts = []
        for mount in container.get("volumeMounts", []):
            source = self._volume_source(pod, volumes[mount["name"]], fs_group)
            if "subPath" in mount:
                source["source"] = str(Path(source["source"]) / mount["subPath"])
            (image.path / mount["mountPath"].lstrip("/")).mkdir(parents=True, exist_ok=True)
            mounts.append(
                {**source, "target": mount["mountPath"], "read_only": bool(mount.get("readOnly"))}
            )
        hosts = pod.workdir / "etc"
        hosts.mkdir(exist_ok=True)
        (hosts / "hosts").write_text(self._hosts(pod))
        (hosts / "hostname").write_text(pod.hostname + "\n")
        search = f"{self.namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}"
        (hosts / "resolv.conf").write_text(f"search {search}\noptions ndots:5\n")
        for name in ("hosts", "hostname", "resolv.conf"):
            mounts.append(
                {"source": str(hosts / name), "target": f"/etc/{name}", "read_only": True}
            )
        command = container.get("command")
        args = container.get("args")
        if command:
            argv = list(command) + list(args or [])
        else:
            argv = list(config.get("Entrypoint") or []) + list(
                args if args is not None else config.get("Cmd") or []
            )
        argv = [expand(str(a), env) for a in argv]
        return {
            "hostname": pod.hostname,
            "pid_file": str(pod.workdir / f"{container['name']}.pid"),
            "root": str(pod.workdir / "root"),
            "image_root": str(image.path),
            "read_only_root": bool(security.get("readOnlyRootFilesystem")),
            "allow_privilege_escalation": security.get("allowPrivilegeEscalation", True),
            "mounts": mounts,
            "working_dir": container.get("workingDir") or config.get("WorkingDir") or "/",
            "uid": uid,
            "gid": gid,
            "groups": groups,
            "env": env,
            "argv": argv,
        }

    # -- running them ------------------------------------------------------------------------

    def _launch(self, pod: Pod, container: dict[str, Any]) -> subprocess.Popen[bytes]:
        """Start one container of the pod (in the pod's network namespace); its log file is
        `<container>.log` in the pod's folder."""
        ref = container["image"]
        if ref not in self.images:
            self.images[ref] = ImageRoot.mount(ref)
        launch = self._launch_spec(pod, container, self.images[ref])
        spec_path = pod.workdir / f"{container['name']}.launch.json"
        spec_path.write_text(json.dumps(launch, indent=2))
        log_path = pod.workdir / f"{container['name']}.log"
        namespace = self.network.namespace_of(pod.address)
        command = ["ip", "netns", "exec", namespace]
        command += [sys.executable, str(LAUNCHER), "start", str(spec_path)]
        return subprocess.Popen(
            command, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def start(self, component: str) -> Pod:
        """Run the pod's init containers to completion, in order, then start its main container
        and its probes."""
        pod = self.pods[component]
        for init in pod.spec.get("initContainers", []):
            proc = self._launch(pod, init)
            code = proc.wait(timeout=600)
            if code != 0:
                log = (pod.workdir / f"{init['name']}.log").read_text(errors="replace")
                raise RuntimeError(
                    f"{pod.name}: init container {init['name']} exited {code}\n{log}"
                )
        container = pod.container
        pod.proc = self._launch(pod, container)
        pod.log_path = pod.workdir / f"{container['name']}.log"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind in container:
                pod.probes[kind] = Probe(kind, container[kind])
        thread = threading.Thread(target=self._probe_loop, args=(pod,), daemon=True)
        thread.start()
        self._threads.append(thread)
        return pod

    def run_test_pod(self, name: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """Run a bare Pod of the chart (a `helm test` hook) to its end: exit code and log."""
        pod = self._pod(self.objects[("Pod", name)])
        self.pods[name] = pod
        self.start(name)
        assert pod.proc is not None
        try:
            pod.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.terminate(name)
        return subprocess.CompletedProcess([name], pod.proc.returncode, self.tail(pod, 200), "")

    def probe_once(self, pod: Pod, spec: dict[str, Any]) -> tuple[bool, str]:
        """Ask one probe once, as the kubelet does; (success, detail)."""
        timeout = float(spec.get("timeoutSeconds", 1))
        if "grpc" in spec:
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            target = f"{pod.address}:{spec['grpc']['port']}"
            with grpc.insecure_channel(target) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                request = health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", ""))
                try:
                    reply = stub.Check(request, timeout=timeout)
                except grpc.RpcError as exc:
                    return False, f"grpc {target}: {exc.code().name}"
                serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                return serving, f"grpc {target}: {status}"
        if "tcpSocket" in spec:
            port = spec["tcpSocket"]["port"]
            if isinstance(port, str):
                port = next(p["containerPort"] for p in pod.container["ports"] if p["name"] == port)
            try:
                with socket.create_connection((pod.address, int(port)), timeout=timeout):
                    return True, f"tcp {pod.address}:{port}: open"
            except OSError as exc:
                return False, f"tcp {pod.address}:{port}: {exc}"
        if "exec" in spec:
            if pod.proc is None or pod.proc.poll() is not None:
                return False, "exec: the container is not running"
            if not (pod.workdir / f"{pod.container['name']}.pid").exists():
                return False, "exec: the container has not started yet"
            done = self.exec(pod, spec["exec"]["command"], timeout=timeout)
            return (
                done.returncode == 0,
                f"exec: exit {done.returncode} {done.stdout.strip()[-200:]}",
            )
        raise ValueError(f"{pod.name}: probe {sorted(spec)} is not modelled")

    def exec(
        self, pod: Pod, argv: list[str], timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside the running container (its namespaces, root, user and env)."""
        assert pod.proc is not None
        name = pod.container["name"]
        spec_path = pod.workdir / f"{name}.launch.json"
        pid = (pod.workdir / f"{name}.pid").read_text()
        command = ["nsenter", "--target", pid, "--mount", "--net", "--uts", "--pid", "--"]
        command += [sys.executable, str(LAUNCHER), "exec", str(spec_path), *argv]
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(command, 124, "", "timed out")

    def _probe_loop(self, pod: Pod) -> None:
        """The kubelet's schedule: the startup probe until it succeeds, then readiness and
        liveness every periodSeconds."""
        started = time.monotonic()
        startup = pod.probes.get("startupProbe")
        next_due: dict[str, float] = {}
        while not self._stop.is_set() and pod.proc is not None and pod.proc.poll() is None:
            now = time.monotonic()
            due = (
                ["startupProbe"]
                if startup and not any(r[1] for r in startup.results)
                else [k for k in ("readinessProbe", "livenessProbe") if k in pod.probes]
            )
            for kind in due:
                probe = pod.probes[kind]
                delay = float(probe.spec.get("initialDelaySeconds", 0))
                if now - started < delay or now < next_due.get(kind, 0):
                    continue
                ok, detail = self.probe_once(pod, probe.spec)
                probe.results.append((now - started, ok, detail))
                next_due[kind] = now + float(probe.spec.get("periodSeconds", 10))
            self._stop.wait(0.5)

    def ready(self, pod: Pod) -> bool:
        readiness = pod.probes.get("readinessProbe")
        return bool(readiness and readiness.results and readiness.results[-1][1])

    def wait_ready(self, components: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pending = [c for c in components if not self.ready(self.pods[c])]
            if not pending:
                return
            for component in pending:
                self.check_failures(self.pods[component])
            time.sleep(1)
        raise TimeoutError(f"not ready after {timeout:.0f} s: {pending}\n{self.describe(pending)}")

    def check_failures(self, pod: Pod) -> None:
        """Raise what the kubelet would act on: an exited container, a failed startup probe
        past its threshold, liveness failing failureThreshold times in a row."""
        if pod.proc is not None and pod.proc.poll() is not None:
            raise RuntimeError(f"{pod.name} exited with {pod.proc.returncode}\n{self.tail(pod)}")
        for kind in ("startupProbe", "livenessProbe"):
            probe = pod.probes.get(kind)
            if probe is None:
                continue
            threshold = int(probe.spec.get("failureThreshold", 3))
            last = [ok for _, ok, _ in probe.results[-threshold:]]
            if len(last) == threshold and not any(last):
                raise RuntimeError(
                    f"{pod.name}: {kind} failed {threshold} times: {probe.results[-1][2]}\n"
                    f"{self.tail(pod)}"
                )

    def tail(self, pod: Pod, lines: int = 40) -> str:
        if pod.log_path is None or not pod.log_path.exists():
            return ""
        return "\n".join(pod.log_path.read_text(errors="replace").splitlines()[-lines:])

    def describe(self, components: list[str]) -> str:
        out = []
        for component in components:
            pod = self.pods[component]
            results = {k: p.results[-1:] for k, p in pod.probes.items()}
            out.append(f"--- {pod.name} {pod.address} probes={results}\n{self.tail(pod)}")
        return "\n".join(out)

    def terminate(self, component: str) -> int | None:
        """SIGTERM, then SIGKILL after the pod's terminationGracePeriodSeconds."""
        pod = self.pods[component]
        if pod.proc is None:
            return None
        if pod.proc.poll() is None:
            pod.proc.send_signal(signal.SIGTERM)
            try:
                pod.proc.wait(timeout=float(pod.spec.get("terminationGracePeriodSeconds", 30)))
            except subprocess.TimeoutExpired:
                os.killpg(pod.proc.pid, signal.SIGKILL)
                pod.proc.wait()
        return pod.proc.returncode

    def close(self) -> None:
        self._stop.set()
        for component in list(self.pods):
            self.terminate(component)
        for image in self.images.values():
            image.unmount()
        self.network.teardown()
        for pod in self.pods.values():
            root = pod.workdir / "root"
            if root.exists() and not os.path.ismount(root):
                shutil.rmtree(root, ignore_errors=True)
