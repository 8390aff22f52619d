"""Limits of a code sandbox, shared by the reward `code` verifier and the `python` tool."""

from __future__ import annotations

from pydantic import Field

from kuberl.common.config.base import Section


class SandboxConfig(Section):
    """Limits and isolation of a code sandbox (`kuberl.common.sandbox`), per program: the reward
    service's `code` verifier (`reward.sandbox`) and the rollout `python` tool
    (`rollout.multi_turn.sandbox`) each have one."""

    cpu_seconds: int = Field(5, ge=1, description="RLIMIT_CPU of each test program.")
    memory_bytes: int = Field(
        512 * 1024 * 1024, ge=16 * 1024 * 1024, description="RLIMIT_AS of each test program."
    )
    max_processes: int = Field(
        16,
        ge=1,
        description="RLIMIT_NPROC: processes (and threads) a program may have at once.",
    )
    max_file_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="RLIMIT_FSIZE: largest file a program may write."
    )
    max_open_files: int = Field(64, ge=8, description="RLIMIT_NOFILE.")
    wall_seconds: float = Field(
        10.0,
        gt=0,
        description="Wall-clock limit of one program (one test; for the python tool, at most "
        "multi_turn.tool_timeout_seconds); its processes are killed.",
    )
    max_output_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        description="Stdout kept per program; a program writing more is killed and fails.",
    )
    max_concurrent: int = Field(
        2,
        ge=1,
        description="Sandboxed runs (reward samples, python tool calls) executing at the same "
        "time; more wait for a free slot.",
    )
    uid_base: int = Field(
        61000,
        ge=1000,
        description="When the service runs as root, each concurrent run executes as its own "
        "uid/gid, the first max_concurrent ids from uid_base up that no other sandbox (reward or "
        "rollout service) on the host holds (claimed with lock files): these ids must belong to "
        "nobody else.",
    )
    tmpfs_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024 * 1024,
        description="Size of the private /tmp (and working directory) of a run, where a mount "
        "namespace is available.",
    )
    require_isolation: bool = Field(
        False,
        description="Refuse to start unless runs get their own network namespace, private "
        "/tmp, /var/tmp and /dev/shm (a mount namespace) and a dedicated uid (the service runs "
        "as root on a kernel that allows namespaces). Without "
        "it, the sandbox falls back to what it can get (a user-namespace network namespace, "
        "rlimits, process-tree cleanup) and logs a warning.",
    )
    python: str | None = Field(
        None, description="Interpreter for the programs (null: the service's own)."
    )
