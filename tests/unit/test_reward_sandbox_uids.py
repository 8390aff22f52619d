"""Sandbox uid claims: two reward services on one host never share a uid, and a dead service's
uids are free again (flock is released by the kernel)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kuberl.common import sandbox
from kuberl.common.sandbox import claim_uids


def test_two_claimants_get_disjoint_uids_in_order(tmp_path: Path) -> None:
    first, _held1 = claim_uids(61000, 2, tmp_path)
    second, _held2 = claim_uids(61000, 3, tmp_path)
    assert (first, second) == ([61000, 61001], [61002, 61003, 61004])


def test_uids_of_a_killed_holder_are_free_again(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from kuberl.common.sandbox import claim_uids; "
            f"claim_uids(61000, 2, Path({str(tmp_path)!r})); print('held', flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    assert claim_uids(61000, 1, tmp_path)[0] == [61002]
    holder.kill()
    holder.wait()
    assert claim_uids(61000, 2, tmp_path)[0] == [61000, 61001]


def test_running_out_of_uids_names_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox, "UID_SEARCH_SPAN", 4)
    _all = claim_uids(70000, 4, tmp_path)
    with pytest.raises(RuntimeError, match="reward.sandbox.uid_base"):
        claim_uids(70000, 1, tmp_path)
