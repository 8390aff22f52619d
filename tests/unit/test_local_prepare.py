"""What `kuberl run` makes of the job file and its flags before any process starts.

`Supervisor._prepare` resolves the job (the demo's, with its locally built model) into the run
folder's job.yaml; the trainer's command line comes from it. No service is started here, so the
`--device cuda` rewrite is checked on a machine without a GPU.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import yaml

from kuberl.local.supervisor import RunOptions, Supervisor
from tests.integration.test_trainer_rl import TORCHRUN
from tests.support import REPO


def _prepared(
    tmp_path: Path, local: dict[str, object] | None = None, **flags: object
) -> Supervisor:
    """The demo job prepared with these flags (and, given `local`, that `job.local` section)."""
    doc = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    doc["job"]["run_dir"] = str(tmp_path / "runs")
    if local is not None:
        doc["job"]["local"] = local
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    supervisor = Supervisor(RunOptions(job_file=job, plain=True, **flags), out=io.StringIO())  # type: ignore[arg-type]
    supervisor._prepare()
    return supervisor


@pytest.fixture(scope="module")
def on_cuda(tmp_path_factory: pytest.TempPathFactory) -> Supervisor:
    return _prepared(tmp_path_factory.mktemp("cuda"), device="cuda", trainer_processes=2)


def test_device_cuda_colocates_one_torch_engine_with_the_trainer_on_gpu_0(
    on_cuda: Supervisor,
) -> None:
    written = yaml.safe_load((on_cuda.run_dir / "job.yaml").read_text())
    assert (
        on_cuda.local.device,
        on_cuda.local.rollout_replicas,
        written["rollout"]["engine"]["device"],
        written["weight_sync"]["transports"],
        "CUDA_VISIBLE_DEVICES" in on_cuda._base_env(),
    ) == ("cuda", 1, "cuda:0", ["cuda_ipc", "shm", "snapshot"], False)


def test_device_cuda_keeps_rollout_replicas_given_on_the_command_line(tmp_path: Path) -> None:
    supervisor = _prepared(tmp_path, device="cuda", rollout_replicas=3)
    assert supervisor.local.rollout_replicas == 3


def test_device_cuda_in_the_job_file_is_the_flag(tmp_path: Path) -> None:
    supervisor = _prepared(tmp_path, local={"device": "cuda"})
    written = yaml.safe_load((supervisor.run_dir / "job.yaml").read_text())
    assert (
        supervisor.local.rollout_replicas,
        written["rollout"]["engine"]["device"],
        written["weight_sync"]["transports"][0],
    ) == (1, "cuda:0", "cuda_ipc")


def test_device_cuda_in_the_job_file_keeps_the_replicas_set_beside_it(tmp_path: Path) -> None:
    supervisor = _prepared(tmp_path, local={"device": "cuda", "rollout_replicas": 2})
    assert supervisor.local.rollout_replicas == 2


def test_on_cpu_every_process_has_cuda_hidden(tmp_path: Path) -> None:
    supervisor = _prepared(tmp_path)
    assert supervisor._base_env()["CUDA_VISIBLE_DEVICES"] == ""


def test_one_trainer_process_runs_without_torchrun(tmp_path: Path) -> None:
    # A world of one needs no agent: `kuberl serve trainer` makes it itself (init_distributed).
    supervisor = _prepared(tmp_path)
    job = supervisor.run_dir / "job.yaml"
    assert supervisor.local.trainer_processes == 1
    assert supervisor._trainer_argv(job) == [
        sys.executable,
        "-m",
        "kuberl.cli",
        "serve",
        "trainer",
        "--config",
        str(job),
    ]


def test_trainer_processes_become_torchrun_processes_with_c10d_rendezvous(
    on_cuda: Supervisor,
) -> None:
    argv = on_cuda._trainer_argv(on_cuda.run_dir / "job.yaml")
    # TORCHRUN: torch.distributed.run, 2 processes per node, c10d rendezvous on loopback
    assert argv[:9] == TORCHRUN
    assert argv[9:] == ["-m", "kuberl.cli", "serve", "trainer", "--config", argv[-1]]
