"""`kuberl.run(job, overrides=...)` end to end, with the model and the training prompts named by
hub id: a script calls the Python API on examples/demo.yaml shortened by overrides, against the
stand-in hub (tests/hub_standin.py; the real hub cannot be reached from here), and gets the
run's summary back. The services are real processes, as under `kuberl run`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kuberl.common.modelbuild import build_model
from tests.hub_standin import hub_standin
from tests.support import REPO

SHORT = [
    "trainer.total_steps=2",
    "trainer.sft_steps=0",
    "trainer.groups_per_step=4",
    "trainer.eval_every=0",
    "trainer.checkpoint_every=2",
    "trainer.batch_wait_seconds=5",
    "rollout.group_size=4",
    "rollout.prompts_per_batch=4",
    "rollout.sampling.max_new_tokens=4",
    "rollout.drain_seconds=5",
    "buffer.max_inflight_groups=8",
    "data.eval[0].limit=8",
]

SCRIPT = """
import json, sys, kuberl
summary = kuberl.run(sys.argv[1], overrides=sys.argv[2:])
print("SUMMARY " + json.dumps(summary))
"""


@pytest.mark.slow
def test_kuberl_run_from_python_trains_a_hub_model_on_a_hub_dataset(tmp_path: Path) -> None:
    repo = tmp_path / "arith-repo" / "data"
    repo.mkdir(parents=True)
    lines = (REPO / "examples/data/arith/train.jsonl").read_text().splitlines()[:64]
    (repo / "train-00000-of-00001.jsonl").write_text("\n".join(lines) + "\n")
    model = build_model(tmp_path / "tiny")
    overrides = [
        *SHORT,
        "model.path=standin/tiny-qwen",
        "data.train[0].path=standin/arith",
        f"data.eval[0].path={REPO / 'examples/data/arith/eval.jsonl'}",
        f"job.run_dir={tmp_path / 'runs'}",
    ]
    with hub_standin() as hub:
        hub.add("model", "standin/tiny-qwen", model)
        hub.add("dataset", "standin/arith", repo.parent)
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), PYTHONUNBUFFERED="1")
        result = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(REPO / "examples/demo.yaml"), *overrides],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
    line = next((x for x in result.stdout.splitlines() if x.startswith("SUMMARY ")), None)
    assert line is not None, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(line.removeprefix("SUMMARY "))
    run_dir = Path(summary["run_dir"])
    job = (run_dir / "job.yaml").read_text()
    assert (summary["status"], summary["steps"], summary["prompts_lost"]) == ("completed", 2, 0)
    assert summary["model_path"].startswith(str(tmp_path / "hf" / "hub" / "models--standin"))
    assert str(tmp_path / "hf" / "hub" / "datasets--standin--arith") in job
