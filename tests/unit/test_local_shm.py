"""The shared-memory folder of a local run belongs to that run alone."""

from __future__ import annotations

from pathlib import Path

from kuberl.local.supervisor import shm_folder_name


def test_runs_whose_folders_share_a_name_get_different_shared_memory_folders(
    tmp_path: Path,
) -> None:
    first, second = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert shm_folder_name(first) != shm_folder_name(second)


def test_the_shared_memory_folder_is_stable_for_one_run_and_names_it(tmp_path: Path) -> None:
    run = tmp_path / "demo-20261123-120000"
    assert shm_folder_name(run) == shm_folder_name(run)
    assert shm_folder_name(run).startswith("kuberl-demo-20261123-120000-")
