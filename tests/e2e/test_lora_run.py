"""`kuberl run examples/demo-lora.yaml`, shortened: RL with LoRA adapters learns the demo task.

The demo's model is built and warm-started by a full SFT (`warm_start_lora: false`: it is random
until then), then GRPO trains rank-3 adapters on every linear layer over that export, with every
service a real process and the torch engine applying each published adapter version in place.
The held-out eval (the trainer's own, 200 questions, 8 samples each at temperature 1) must rise by
at least 10 points over the warm start; every published version must be at most 5% of the
model's bytes; the final checkpoint's adapter must load in PEFT over the warm start's model and
hold the weights the engines served.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import REPO

STEPS = 50
# The run takes about 2 min on 2 idle cores; 5-12 min when the machine is shared.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _job(tmp: Path) -> Path:
    doc = yaml.safe_load((REPO / "examples" / "demo-lora.yaml").read_text())
    doc["job"]["name"] = "demo-lora-e2e"
    doc["job"]["run_dir"] = str(tmp / "runs")
    doc["trainer"].update(total_steps=STEPS, eval_every=0, checkpoint_every=STEPS)
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("lora-run")
    run_dir = tmp / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "kuberl.cli", "run", str(_job(tmp)), "--run-dir", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def test_the_demo_with_lora_learns_over_its_warm_start(run: tuple[Path, dict[str, Any]]) -> None:
    _, summary = run
    assert (summary["status"], summary["steps"], summary["prompts_lost"]) == ("completed", STEPS, 0)
    gain = summary["eval_accuracy_end"] - summary["eval_accuracy_start"]
    assert gain >= 0.10, summary["eval_rounds"]


def test_every_weight_update_is_the_adapters_at_most_5_percent_of_the_model(
    run: tuple[Path, dict[str, Any]],
) -> None:
    run_dir, summary = run
    model_bytes = (Path(summary["warm_start_model"]) / "model.safetensors").stat().st_size
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    published = [r["publish/bytes"] for r in rows if "publish/bytes" in r]
    assert len(published) >= STEPS and max(published) <= 0.05 * model_bytes
    # every replica loaded the last adapter version
    assert {r["policy_version"] for r in summary["replicas"].values()} == {STEPS}


def test_the_final_adapter_loads_in_peft_over_the_warm_start_model(
    run: tuple[Path, dict[str, Any]],
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, summary = run
    checkpoints = run_dir / "checkpoints"
    final = checkpoints / (checkpoints / "latest").read_text().strip()
    config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(summary["warm_start_model"])
    model = PeftModel.from_pretrained(base, final / "adapter")
    b = dict(model.named_parameters())[
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight"
    ]
    assert (config["r"], config["base_model_name_or_path"]) == (3, summary["warm_start_model"])
    assert not (final / "hf").exists() and float(b.abs().max()) > 0


def test_a_lora_warm_start_trains_adapters_and_rl_starts_from_its_merged_export(
    tmp_path: Path,
) -> None:
    doc = yaml.safe_load((REPO / "examples" / "demo-lora.yaml").read_text())
    doc["job"].update(name="lora-warm", run_dir=str(tmp_path / "runs"))
    doc["job"]["local"]["warm_start_lora"] = True
    doc["data"]["eval"][0]["limit"] = 4
    doc["rollout"].update(group_size=4, prompts_per_batch=4, drain_seconds=5)
    doc["trainer"].update(total_steps=2, groups_per_step=4, eval_every=0, sft_steps=4)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "kuberl.cli", "run", str(job), "--run-dir", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    warm = Path(summary["warm_start_model"])
    checkpoints = run_dir / "checkpoints"
    final = checkpoints / (checkpoints / "latest").read_text().strip()
    config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert (warm.name, summary["steps"]) == ("merged", 2)
    assert (warm.parent / "adapter" / "adapter_model.safetensors").exists()
    assert config["base_model_name_or_path"] == str(warm)
