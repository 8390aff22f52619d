"""End to end against TRL: the demo task through TRL's `GRPOTrainer` and through `kuberl run`.

Both sides train the demo of `examples/demo.yaml` from the same checkpoint, in one run of this
script on this machine, one after the other (never at the same time):

1. **Warm start, shared.** The demo's SFT warm start (`trainer.sft_steps` on `trainer.sft_data`
   at `job.local.warm_start_lr`) runs once, through kuberl's trainer in `sft` mode (`kuberl serve
   trainer`, what `kuberl run` does before RL), and both sides start RL from its HF export. It
   is not part of either side's wall time.
2. **TRL.** `trl.GRPOTrainer` in a child process with the demo's RL settings: the same prompts
   (the demo's train file), group size (`num_generations`), prompts per step (16 groups of 8 =
   128 completions per optimizer step, one step per generation batch), learning rate (constant,
   no warm-up), AdamW betas/eps/weight decay, gradient clipping, clip range (0.2 / 0.28), DAPO
   token-mean loss, no KL, fp32, and TRL's own generation (`model.generate`) with the demo's
   sampling (temperature 1, top-p 1, top-k off, 6 new tokens, EOS stops). Its reward function
   calls kuberl's `gsm8k` verifier directly (`kuberl.reward.verifiers.gsm8k.score`), the one the
   demo's reward service runs. A callback saves the policy every `--eval-every` steps; the time
   spent saving is subtracted from TRL's clock.
3. **kuberl.** `kuberl run` on the demo's job file with `model.path` set to the warm start and
   no warm start of its own: buffer, reward, weight-sync, two rollout replicas and the trainer as
   separate processes, exactly as `make demo`. The trainer checkpoints every `--eval-every` steps
   (that time stays on kuberl's clock); the demo's own in-loop eval rounds (sampled at
   temperature 1) are turned off so that both sides are judged by the same evaluator.
4. **Evaluation, after both runs.** Every saved policy of both sides (and the warm start) is
   evaluated the same way: greedy decoding of the demo's 200 held-out questions (6 new tokens),
   scored by the same `gsm8k` verifier. Evaluation time is on nobody's clock.

Wall time of a side runs from launching its process (imports, model loading and, for kuberl,
the embedded Redis and every service's start-up included) to the end of its last optimizer
step. The figures: wall time, trained samples per second, accuracy at the end, accuracy of both
at equal wall time (the shorter run's end), and the headline: the wall time kuberl needs to
reach TRL's final accuracy, as a ratio to TRL's wall time (goal: at most 0.7). It runs
`--repeat` such pairs (default 4, the order of the two sides alternated), pair i seeded with the
job's seed (or `--seed`) + i on both sides, and reports the medians over the pairs with every
pair's figures. `learning_per_sample` compares how much the two learn from the same number of
trained samples: each side's mean accuracy over the second half of training, pair by pair, with
the mean difference and its standard error (the headline, a first crossing of a noisy curve over
a noisy end point, cannot resolve a difference of a point or two).

    .venv/bin/python benchmarks/vs_trl.py            # the full demo (200 RL steps), ~10-15 min
    .venv/bin/python benchmarks/vs_trl.py --quick    # a smoke test of every stage, ~2-3 min

The last line printed is one JSON object with both sides' figures, the ratio, the goal and the
machine. Everything else (logs, checkpoints, TRL's log history) stays in `--out`.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "demo.yaml"
GOAL_RATIO = 0.7
#: The generation-heavy task's goal (issue #30): long responses are where overlapping
#: generation with training should pay.
GOAL_RATIO_LONG = 0.6
#: What `--task long` changes in the demo job (everything else, both sides, is the demo's).
LONG_TASK = {
    "max_new_tokens": 128,  # the traces are 80-108 characters, one token each, plus EOS
    # 24 completions per step: decoding is then 61-67% of TRL's step, against about half at 64
    # (docs/benchmarks.md, "The generation-heavy task").
    "groups_per_step": 3,
    "rl_steps": 160,
    # The SFT checkpoint whose greedy accuracy (0.595) RL raises over the run; at 300 steps SFT
    # sits in a dip (0.57) that RL undoes in under ten steps, leaving nothing to race on.
    "sft_steps": 225,
    # A fifth of the demo's: at 24 completions a step, 5e-5 swings both sides' accuracy by up to
    # 0.4 between neighbouring policies; 2e-5 climbs steadily (docs/benchmarks.md).
    "lr": 2e-5,
}


# ---------------------------------------------------------------------------- the demo's task


def load_demo(path: Path) -> dict[str, Any]:
    """The demo job file as a plain dict, its data paths made absolute (from the repository)."""
    doc = yaml.safe_load(path.read_text())
    for kind in ("train", "eval"):
        for ds in doc.get("data", {}).get(kind, []):
            ds["path"] = str((REPO / ds["path"]).resolve())
    sft = doc.get("trainer", {}).get("sft_data")
    if sft:
        doc["trainer"]["sft_data"] = str((REPO / sft).resolve())
    return doc


def long_task(doc: dict[str, Any], out: Path) -> dict[str, Any]:
    """The demo job turned generation-heavy (`--task long`): three-digit additions whose SFT
    responses are a worked trace (`kuberl.local.arith.worked_steps`, 80-108 tokens), the same
    `gsm8k` verifier on the final `####` number, up to 128 new tokens, and `LONG_TASK`'s batch,
    steps, learning rate and warm start. The data are generated (seeded) into `out`."""
    from kuberl.local import arith

    data = out / "data-long"
    arith.write(data, arith.generate(seed=0, steps=True))
    job = copy.deepcopy(doc)
    job["job"]["name"] = "demo-long"
    job["data"]["train"] = [{"path": str(data / "train.jsonl"), "name": "arith-steps"}]
    job["data"]["eval"] = [{"path": str(data / "eval.jsonl"), "name": "arith-steps-heldout"}]
    job["rollout"]["sampling"]["max_new_tokens"] = LONG_TASK["max_new_tokens"]
    # Two steps ahead, as the demo's window is at its 16 groups per step; each replica leases one
    # step's prompts per batch.
    job["buffer"]["max_inflight_groups"] = 2 * LONG_TASK["groups_per_step"]
    job["rollout"]["prompts_per_batch"] = LONG_TASK["groups_per_step"]
    tc = job["trainer"]
    tc.update(
        sft_data=str(data / "sft.jsonl"),
        sft_steps=LONG_TASK["sft_steps"],
        groups_per_step=LONG_TASK["groups_per_step"],
        total_steps=LONG_TASK["rl_steps"],
    )
    tc["optimizer"]["lr"] = LONG_TASK["lr"]
    return job


def rl_settings(doc: dict[str, Any]) -> dict[str, Any]:
    """The RL settings both sides must share, read from the (validated) demo job."""
    from kuberl.common.config import parse_job_config

    cfg = parse_job_config(doc, env={}, source=str(DEMO))
    if cfg.trainer.algorithm.advantage != "grpo" or cfg.trainer.algorithm.kl.coef != 0:
        raise SystemExit("vs_trl compares GRPO without KL; the demo job changed: update the script")
    s = cfg.rollout.sampling
    opt = cfg.trainer.optimizer
    alg = cfg.trainer.algorithm
    return {
        "seed": cfg.job.seed,
        "group_size": cfg.rollout.group_size,
        "groups_per_step": cfg.trainer.groups_per_step,
        "rl_steps": cfg.trainer.total_steps,
        "lr": opt.lr,
        "betas": list(opt.betas),
        "eps": opt.eps,
        "weight_decay": opt.weight_decay,
        "grad_clip": opt.grad_clip,
        "warmup_steps": opt.warmup_steps,
        "clip_low": alg.clip_low,
        "clip_high": alg.clip_high,
        "loss_agg": alg.loss_agg,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "max_new_tokens": s.max_new_tokens,
        "sft_steps": cfg.trainer.sft_steps,
        "train_file": cfg.data.train[0].path,
        "eval_file": cfg.data.eval[0].path,
        "verifiers": dict(cfg.reward.verifiers),
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def child_env(threads: int) -> dict[str, str]:
    """CPU only, and torch's thread count for a child process."""
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("KUBERL_") and "__" in k]:
        del env[key]  # only this script decides the jobs' settings
    env.update(
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


def children_cpu_seconds() -> float:
    """User + system CPU seconds of every reaped descendant of this process so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_logged(argv: list[str], log: Path, env: dict[str, str], timeout: float) -> float:
    """Run a child with stdout+stderr in `log`; raise with the log's tail when it fails.

    Returns the CPU seconds of the child and every process under it that was waited for
    (the supervisor waits for its services, torchrun for its workers)."""
    before = children_cpu_seconds()
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = -9
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited {rc}; last lines of {log}:\n{tail}")
    return children_cpu_seconds() - before


# ---------------------------------------------------------------------------- 1. warm start


def warm_start(doc: dict[str, Any], steps: int, out: Path, timeout: float) -> Path:
    """The demo's SFT warm start through kuberl's trainer (as `kuberl run` does it); its HF export.

    Same settings as the supervisor's warm start (`kuberl.local.supervisor`): mode sft for
    `steps` steps at `job.local.warm_start_lr`, one checkpoint with an HF export at the end."""
    job = copy.deepcopy(doc)
    tc = job["trainer"]
    lr = job.get("job", {}).get("local", {}).get("warm_start_lr") or tc["optimizer"]["lr"]
    tc.update(
        mode="sft",
        total_steps=steps,
        sft_steps=0,
        publish_weights=False,
        checkpoint_dir=str(out / "checkpoints"),
        checkpoint_every=steps,
        keep_checkpoints=1,
        export_hf=True,
        resume=False,
        linger_seconds=0.0,
    )
    tc["optimizer"]["lr"] = lr
    tc["server"] = {"host": "127.0.0.1", "port": 0, "metrics_port": 0}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "warm-start.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    argv = [sys.executable, "-m", "kuberl.cli", "serve", "trainer", "--config", str(path)]
    run_logged(argv, out / "warm-start.log", child_env(1), timeout)
    latest = out / "checkpoints" / "latest"
    hf = out / "checkpoints" / latest.read_text().strip() / "hf"
    if not (hf / "config.json").exists():
        raise RuntimeError(f"the warm start wrote no HF export at {hf}")
    return hf


# ---------------------------------------------------------------------------- 2. TRL


def run_trl(spec: dict[str, Any], out: Path, threads: int, timeout: float) -> dict[str, Any]:
    """TRL's GRPOTrainer in a child process (`--child-trl`); its timings and snapshots."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(out), "threads": threads, "launched": time.time()}
    (out / "spec.json").write_text(json.dumps(spec, indent=2))
    argv = [sys.executable, str(Path(__file__).resolve()), "--child-trl", str(out / "spec.json")]
    cpu = run_logged(argv, out / "trl.log", child_env(threads), timeout)
    return {**json.loads((out / "result.json").read_text()), "cpu_seconds": cpu}


def verifier_reward(
    prompts: list[str], completions: list[str], answer: list[str], **_: Any
) -> list[float]:
    """TRL's reward function: the demo's reward, kuberl's `gsm8k` verifier with weight 1.0, on
    the same (prompt, decoded response, answer) the reward service would get."""
    from kuberl.reward.sample import RewardSample
    from kuberl.reward.verifiers import gsm8k

    return [
        gsm8k.score(RewardSample(prompt=p, response=c, answer=a)).score
        for p, c, a in zip(prompts, completions, answer, strict=True)
    ]


def trl_child(spec_path: Path) -> None:
    """The TRL side (runs in its own process so its imports and start-up are on its clock)."""
    spec = json.loads(spec_path.read_text())
    launched = float(spec["launched"])
    import torch

    torch.set_num_threads(int(spec["threads"]))
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from kuberl.common.modelbuild import load_tokenizer

    out = Path(spec["out"])
    rows = read_jsonl(Path(spec["train_file"]))
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    per_step = spec["group_size"] * spec["groups_per_step"]
    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        seed=spec["seed"],
        max_steps=spec["rl_steps"],
        per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=spec["group_size"],
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        top_k=spec["top_k"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=spec["warmup_steps"],
        adam_beta1=spec["betas"][0],
        adam_beta2=spec["betas"][1],
        adam_epsilon=spec["eps"],
        weight_decay=spec["weight_decay"],
        max_grad_norm=spec["grad_clip"],
        epsilon=spec["clip_low"],
        epsilon_high=spec["clip_high"],
        loss_type="dapo",
        beta=0.0,
        scale_rewards="group",
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    # Generation's share of TRL's step: the time in `model.generate` (TRL calls it on the model
    # itself, on one CPU process unwrapped), against the training loop's.
    generate = model.generate
    gen_clock = {"seconds": 0.0, "calls": 0}

    def timed_generate(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            gen_clock["seconds"] += time.perf_counter() - t
            gen_clock["calls"] += 1

    model.generate = timed_generate
    tokenizer = load_tokenizer(spec["model"])  # the tokenizer kuberl's services use
    every = int(spec["eval_every"])
    snapshots: list[dict[str, Any]] = []
    clock = {"excluded": 0.0, "train_begin": 0.0, "train_end": 0.0}

    class Snapshots(TrainerCallback):  # type: ignore[misc]
        """Saves the policy every `every` steps; the saving time is taken off TRL's clock."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock["train_begin"] = time.time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            step = int(state.global_step)
            if step % every and step != spec["rl_steps"]:
                return
            now = time.time()
            if step == spec["rl_steps"]:
                clock["train_end"] = now
            target = out / "snapshots" / f"step-{step:06d}"
            kw["model"].save_pretrained(target, safe_serialization=True)
            snapshots.append(
                {"step": step, "seconds": now - launched - clock["excluded"], "path": str(target)}
            )
            clock["excluded"] += time.time() - now

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=verifier_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Snapshots()],
    )
    trainer.train()
    end = clock["train_end"] or time.time()
    result = {
        "wall_seconds": end - launched - clock["excluded"],
        "startup_seconds": clock["train_begin"] - launched,
        "excluded_seconds": clock["excluded"],
        "generate_seconds": gen_clock["seconds"],
        "generate_calls": gen_clock["calls"],
        "train_loop_seconds": end - clock["train_begin"] - clock["excluded"],
        "steps": int(trainer.state.global_step),
        "samples": int(trainer.state.global_step) * per_step,
        "snapshots": snapshots,
        "log_history": trainer.state.log_history,
        "trl_version": __import__("trl").__version__,
        "threads": torch.get_num_threads(),
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))


# ---------------------------------------------------------------------------- 3. kuberl


def run_kuberl(
    doc: dict[str, Any],
    model: Path,
    steps: int,
    every: int,
    out: Path,
    timeout: float,
    replicas: int | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """`kuberl run` on the demo job from `model` (with `job.seed` = seed when given); step
    times and the checkpoints it left."""
    job = copy.deepcopy(doc)
    if seed is not None:
        job.setdefault("job", {})["seed"] = seed
    tc = job["trainer"]
    tc.update(
        total_steps=steps,
        sft_steps=0,
        sft_data=None,
        checkpoint_every=every,
        keep_checkpoints=10_000,
        export_hf=True,
        eval_every=0,
    )
    job["model"] = {**job.get("model", {}), "path": str(model)}
    job["data"]["eval"] = []  # judged offline by the same evaluator as TRL (module docstring)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    # The run folder's name also names its shared-memory folder (/dev/shm/kuberl-<name>): a
    # name no other run on this machine uses.
    run = out / f"kuberl-vs-trl-{uuid.uuid4().hex[:8]}"
    argv = [sys.executable, "-m", "kuberl.cli", "run", str(path), "--run-dir", str(run), "--plain"]
    if replicas:
        argv += ["--rollout-replicas", str(replicas)]
    env = child_env(1)
    del env["OMP_NUM_THREADS"]  # the supervisor gives each service its share of the cores
    del env["MKL_NUM_THREADS"]
    launched = time.time()
    cpu = run_logged(argv, out / "kuberl-run.log", env, timeout)
    process_seconds = time.time() - launched
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "rl"]
    summary = json.loads((run / "summary.json").read_text())
    checkpoints = run / "checkpoints"
    snapshots = []
    for r in rows:
        hf = checkpoints / f"step-{int(r['step']):06d}" / "hf"
        if (hf / "config.json").exists():
            snapshots.append(
                {"step": int(r["step"]), "seconds": r["time"] - launched, "path": str(hf)}
            )
    groups = sum(float(r.get("batch/groups") or 0) for r in rows)
    return {
        "wall_seconds": rows[-1]["time"] - launched,
        "process_seconds": process_seconds,
        "cpu_seconds": cpu,
        "first_step_seconds": rows[0]["time"] - launched,
        "steps": int(rows[-1]["step"]),
        "samples": int(
            summary.get("trajectories_trained") or groups * doc["rollout"]["group_size"]
        ),
        "snapshots": snapshots,
        "summary": {
            k: summary.get(k)
            for k in (
                "status",
                "seconds_per_step",
                "trained_tokens_per_second",
                "generated_tokens_per_second",
                "groups_dropped",
                "staleness_max",
                "prompts_lost",
                "groups_duplicated",
                "phase_seconds",
            )
        },
        "run_dir": str(run),
    }


# ---------------------------------------------------------------------------- 4. evaluation


class Evaluator:
    """Greedy accuracy on the held-out questions, scored by kuberl's gsm8k verifier.

    The model is built once from `base` (the warm start: config and tokenizer) and each policy's
    `model.safetensors` is loaded into it, so that evaluating a saved policy costs one batched
    `generate` (all questions left-padded together, `new_tokens` new tokens, EOS stops)."""

    def __init__(self, base: Path, eval_file: Path, new_tokens: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from kuberl.common.modelbuild import load_tokenizer

        hf_logging.disable_progress_bar()
        self.tok = load_tokenizer(base)  # the tokenizer kuberl's services use
        self.model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
        self.rows = read_jsonl(eval_file)
        self.new_tokens = new_tokens
        prompts = [self.tok.encode(r["prompt"], add_special_tokens=False) for r in self.rows]
        self.width = max(len(p) for p in prompts)
        pad = self.tok.pad_token_id
        self.pad = pad if pad is not None else self.tok.eos_token_id
        left = [self.width - len(p) for p in prompts]
        self.ids = torch.tensor([[self.pad] * n + p for n, p in zip(left, prompts, strict=True)])
        self.mask = torch.tensor(
            [[0] * n + [1] * len(p) for n, p in zip(left, prompts, strict=True)]
        )  # [N, P]

    def load(self, policy: Path) -> None:
        """Load `policy`/model.safetensors (an HF export; a tied LM head may be absent)."""
        from safetensors.torch import load_file

        state = load_file(str(policy / "model.safetensors"))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
            raise RuntimeError(f"{policy}: missing {missing}, unexpected {unexpected}")

    def accuracy(self) -> float:
        import torch

        from kuberl.reward.sample import RewardSample
        from kuberl.reward.verifiers import gsm8k

        with torch.no_grad():
            out = self.model.generate(
                input_ids=self.ids,
                attention_mask=self.mask,
                do_sample=False,
                max_new_tokens=self.new_tokens,
                eos_token_id=self.tok.eos_token_id,
                pad_token_id=self.pad,
            )
        texts = self.tok.batch_decode(out[:, self.width :], skip_special_tokens=True)
        scores = [
            gsm8k.score(RewardSample(prompt=r["prompt"], response=t, answer=r["answer"])).score
            for r, t in zip(self.rows, texts, strict=True)
        ]
        return sum(scores) / len(scores)

    def curve(self, snapshots: list[dict[str, Any]], start: float) -> list[dict[str, Any]]:
        """(step, seconds, accuracy) from step 0 (the warm start, at 0 s) to the last policy."""
        points = [{"step": 0, "seconds": 0.0, "accuracy": start}]
        for snap in snapshots:
            self.load(Path(snap["path"]))
            points.append(
                {
                    "step": snap["step"],
                    "seconds": round(snap["seconds"], 2),
                    "accuracy": self.accuracy(),
                }
            )
        return points


def greedy_accuracy(
    model_dir: Path, tokenizer_dir: Path, eval_file: Path, new_tokens: int
) -> float:
    """Greedy held-out accuracy of the policy in `model_dir` (config from `tokenizer_dir`)."""
    ev = Evaluator(tokenizer_dir, eval_file, new_tokens)
    ev.load(model_dir)
    return ev.accuracy()


def smoothed(curve: list[dict[str, Any]], window: int) -> list[float]:
    """Each point's accuracy averaged with the RL points before it (up to `window` points).

    One greedy evaluation on 200 questions moves by a few points from one saved policy to the
    next; the trailing mean keeps a single lucky (or unlucky) evaluation from deciding the
    headline. Step 0 (the shared warm start) stays as it is."""
    out = [float(curve[0]["accuracy"])]
    for i in range(1, len(curve)):
        part = [float(p["accuracy"]) for p in curve[max(1, i - window + 1) : i + 1]]
        out.append(sum(part) / len(part))
    return out


def accuracy_at(curve: list[dict[str, Any]], values: list[float], seconds: float) -> float:
    """`values` (a curve's raw or smoothed accuracy) of the latest policy saved by `seconds`."""
    last = [i for i, p in enumerate(curve) if p["seconds"] <= seconds + 1e-9][-1]
    return round(values[last], 4)


def time_to_reach(curve: list[dict[str, Any]], values: list[float], target: float) -> float | None:
    """Seconds until the first RL point whose value is >= target (None: never)."""
    hit = [p for p, v in zip(curve, values, strict=True) if p["step"] > 0 and v >= target - 1e-9]
    return float(hit[0]["seconds"]) if hit else None


# ---------------------------------------------------------------------------- report


def machine() -> str:
    load = os.getloadavg()
    return (
        f"{platform.node()}: {os.cpu_count()} CPU cores, {platform.machine()}, "
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"load average at start {load[0]:.1f}"
    )


def figures(
    trl: dict[str, Any],
    kub: dict[str, Any],
    trl_curve: list[dict[str, Any]],
    kub_curve: list[dict[str, Any]],
    window: int = 3,
    goal: float = GOAL_RATIO,
) -> dict[str, Any]:
    """Both sides' figures and the headline ratio.

    TRL's final accuracy is the mean of its last `window` evaluations; kuberl reaches it at the
    first saved policy whose trailing mean over `window` evaluations is at least that much."""
    trl_s, kub_s = smoothed(trl_curve, window), smoothed(kub_curve, window)
    target = trl_s[-1]
    reach = time_to_reach(kub_curve, kub_s, target)
    ratio = reach / trl["wall_seconds"] if reach is not None else None
    equal = min(trl["wall_seconds"], kub["wall_seconds"])

    def side(res: dict[str, Any], curve: list[dict[str, Any]], sm: list[float]) -> dict[str, Any]:
        return {
            "wall_seconds": round(res["wall_seconds"], 1),
            "samples": res["samples"],
            "samples_per_second": round(res["samples"] / res["wall_seconds"], 1),
            "cpu_seconds": round(res["cpu_seconds"], 1),
            "load_average_start_end": res.get("load"),
            "final_accuracy": round(sm[-1], 4),
            "final_accuracy_last_eval": curve[-1]["accuracy"],
            "accuracy_at_equal_wall_time": accuracy_at(curve, sm, equal),
            "curve": [{**p, "smoothed": round(v, 4)} for p, v in zip(curve, sm, strict=True)],
        }

    return {
        "trl": {
            **side(trl, trl_curve, trl_s),
            "startup_seconds": round(trl["startup_seconds"], 1),
            "snapshot_seconds_excluded": round(trl["excluded_seconds"], 1),
            "torch_threads": trl["threads"],
            "version": trl["trl_version"],
            "mean_completion_tokens": _mean_logged(trl.get("log_history", []), _LENGTH_KEY),
            "generation_share_of_training_loop": (
                round(trl["generate_seconds"] / trl["train_loop_seconds"], 3)
                if trl.get("train_loop_seconds")
                else None
            ),
        },
        "kuberl": {
            **side(kub, kub_curve, kub_s),
            "first_step_seconds": round(kub["first_step_seconds"], 1),
            "process_seconds": round(kub["process_seconds"], 1),
            "run": kub["summary"],
        },
        "equal_wall_time_seconds": round(equal, 1),
        "start_accuracy": trl_curve[0]["accuracy"],
        "smoothing_window": window,
        "kuberl_seconds_to_trl_final_accuracy": round(reach, 1) if reach is not None else None,
        "ratio_kuberl_time_to_trl_final_over_trl_wall": round(ratio, 3) if ratio else None,
        "ratio_wall_kuberl_over_trl": round(kub["wall_seconds"] / trl["wall_seconds"], 3),
        "ratio_samples_per_second_kuberl_over_trl": round(
            trl["wall_seconds"] / kub["wall_seconds"] * kub["samples"] / trl["samples"], 3
        ),
        "ratio_cpu_seconds_kuberl_over_trl": round(kub["cpu_seconds"] / trl["cpu_seconds"], 3),
        "goal": f"kuberl reaches TRL's final accuracy in <= {goal}x TRL's wall time",
        "goal_met": ratio is not None and ratio <= goal,
    }


_LENGTH_KEY = "completions/mean_length"


def _mean_logged(history: list[dict[str, Any]], key: str) -> float | None:
    """The mean of `key` over TRL's log rows that have it (None when none has)."""
    values = [float(row[key]) for row in history if key in row]
    return round(statistics.fmean(values), 1) if values else None


def _median(values: list[float | None]) -> float | None:
    """Median with None as +infinity (a pair where kuberl never got there); None if that wins."""
    ordered = sorted(float("inf") if v is None else v for v in values)
    mid = len(ordered) // 2
    m = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return None if m == float("inf") else round(m, 3)


def _second_half(curve: list[dict[str, Any]]) -> list[float]:
    """The raw accuracies of the policies saved after half of the run's RL steps (the last
    point's alone for a run that saved none after step 0)."""
    half = curve[-1]["step"] / 2
    late = [p for p in curve if p["step"] > half] or curve[-1:]
    return [float(p["accuracy"]) for p in late]


def _neighbour_changes(curve: list[dict[str, Any]]) -> list[float]:
    """Changes in accuracy from one saved policy to the next, in the run's second half."""
    values = _second_half(curve)
    return [b - a for a, b in itertools.pairwise(values)]


def _mean_and_stderr(values: list[float]) -> tuple[float, float | None]:
    mean = statistics.fmean(values)
    stderr = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return round(mean, 4), (round(stderr, 4) if stderr is not None else None)


def learning_per_sample(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the two sides learn alike per trained sample, from the same saved steps.

    Both sides save a policy at the same RL steps, i.e. after the same number of trained samples.
    Per pair, each side's mean accuracy over the policies of the run's second half (where both
    plateau) and the paired difference kuberl - TRL; over the pairs, the mean difference and its
    standard error, the same for the final accuracies (the mean of the last three evaluations,
    the headline's target), and `eval_noise`: how much one evaluation of one policy scatters,
    estimated as the standard deviation of the change between neighbouring saved policies of
    the second half over sqrt(2) (neighbours differ by a few optimizer steps)."""
    second = {
        side: [statistics.fmean(_second_half(p[side]["curve"])) for p in pairs]
        for side in ("trl", "kuberl")
    }
    curves = [p[side]["curve"] for p in pairs for side in ("trl", "kuberl")]
    late = [d for curve in curves for d in _neighbour_changes(curve)]
    diff, diff_err = _mean_and_stderr(
        [k - t for k, t in zip(second["kuberl"], second["trl"], strict=True)]
    )
    final, final_err = _mean_and_stderr(
        [p["kuberl"]["final_accuracy"] - p["trl"]["final_accuracy"] for p in pairs]
    )
    return {
        "second_half_accuracy": {
            side: [round(v, 4) for v in values] for side, values in second.items()
        },
        "second_half_difference": diff,
        "second_half_difference_stderr": diff_err,
        "final_accuracy_difference": final,
        "final_accuracy_difference_stderr": final_err,
        "eval_noise": round(statistics.stdev(late) / math.sqrt(2), 4) if len(late) > 1 else None,
    }


def summarize(pairs: list[dict[str, Any]], goal: float = GOAL_RATIO) -> dict[str, Any]:
    """The medians over the TRL/kuberl pairs (each pair's figures are in `pairs`)."""
    side_keys = (
        "wall_seconds",
        "samples",
        "samples_per_second",
        "cpu_seconds",
        "final_accuracy",
        "accuracy_at_equal_wall_time",
    )
    ratio_keys = (
        "ratio_kuberl_time_to_trl_final_over_trl_wall",
        "ratio_wall_kuberl_over_trl",
        "ratio_samples_per_second_kuberl_over_trl",
        "ratio_cpu_seconds_kuberl_over_trl",
        "kuberl_seconds_to_trl_final_accuracy",
        "equal_wall_time_seconds",
    )
    out: dict[str, Any] = {
        side: {k: _median([p[side][k] for p in pairs]) for k in side_keys}
        for side in ("trl", "kuberl")
    }
    out.update({k: _median([p[k] for p in pairs]) for k in ratio_keys})
    for side in ("trl", "kuberl"):
        out[side]["samples"] = int(out[side]["samples"] or 0)
    ratio = out["ratio_kuberl_time_to_trl_final_over_trl_wall"]
    out["trl"]["version"] = pairs[0]["trl"]["version"]
    out["trl"]["torch_threads"] = pairs[0]["trl"].get("torch_threads")
    out["pair_ratios"] = [p["ratio_kuberl_time_to_trl_final_over_trl_wall"] for p in pairs]
    out["learning_per_sample"] = learning_per_sample(pairs)
    for key in ("generation_share_of_training_loop", "mean_completion_tokens"):
        out["trl"][key] = _median([p["trl"].get(key) for p in pairs])
    out["goal"] = f"kuberl reaches TRL's final accuracy in <= {goal}x TRL's wall time"
    out["goal_met"] = ratio is not None and ratio <= goal
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few steps of everything")
    parser.add_argument("--job", type=Path, default=DEMO, help="the demo job file")
    parser.add_argument(
        "--task",
        choices=("demo", "long"),
        default="demo",
        help="demo: the job as it is; long: its generation-heavy variant (`long_task`)",
    )
    parser.add_argument("--rl-steps", type=int, help="RL steps (default: the job's)")
    parser.add_argument("--sft-steps", type=int, help="warm-start steps (default: the job's)")
    parser.add_argument("--eval-every", type=int, help="steps between saved policies")
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch threads of TRL (default: one per CPU this process may use, as torch "
        "defaults to on a VM without SMT and a TRL user runs it; kuberl shares the same CPUs)",
    )
    parser.add_argument(
        "--rollout-replicas", type=int, help="kuberl's rollout replicas (default: the job's)"
    )
    parser.add_argument(
        "--repeat", type=int, help="TRL/kuberl pairs, order alternated (default 4; quick 1)"
    )
    parser.add_argument(
        "--seed", type=int, help="seed of the first pair, pair i gets seed + i (default: the job's)"
    )
    parser.add_argument("--warm-start", type=Path, help="reuse this warm-start HF folder")
    parser.add_argument("--out", type=Path, help="work folder (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per stage, seconds")
    parser.add_argument("--child-trl", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_trl:
        trl_child(args.child_trl)
        return 0

    doc = load_demo(args.job)
    out = args.out or Path(tempfile.mkdtemp(prefix="kuberl-vs-trl-"))
    out.mkdir(parents=True, exist_ok=True)
    long = args.task == "long"
    if long:
        doc = long_task(doc, out)
    goal = GOAL_RATIO_LONG if long else GOAL_RATIO
    settings = rl_settings(doc)
    quick = {"rl_steps": 6, "sft_steps": 40, "eval_every": 2}
    rl_steps = args.rl_steps or (quick["rl_steps"] if args.quick else settings["rl_steps"])
    sft_steps = args.sft_steps or (quick["sft_steps"] if args.quick else settings["sft_steps"])
    every = args.eval_every or (quick["eval_every"] if args.quick else 10)
    repeat = args.repeat or (1 if args.quick else 4)
    settings.update(rl_steps=rl_steps, sft_steps=sft_steps, eval_every=every)
    where = machine()
    started = time.time()
    try:
        t = time.time()
        model = args.warm_start or warm_start(doc, sft_steps, out / "warm-start", args.timeout)
        warm_seconds = time.time() - t
        print(f"warm start: {model} ({warm_seconds:.0f} s)", file=sys.stderr)
        ev = Evaluator(model, Path(settings["eval_file"]), settings["max_new_tokens"])
        start_acc = ev.accuracy()
        pairs = []
        for i in range(repeat):
            # Alternate which side goes first, so a change in the machine's load hits both.
            order = ("trl", "kuberl") if i % 2 == 0 else ("kuberl", "trl")
            # Each pair is a replicate on both sides: its own seed (TRL's sampler, init of its
            # RNGs; kuberl's epoch order). One seed for all pairs would repeat TRL's run exactly
            # (it is synchronous) while kuberl's asynchronous runs vary, comparing one TRL draw
            # with several kuberl draws.
            seed = (settings["seed"] if args.seed is None else args.seed) + i
            runs: dict[str, dict[str, Any]] = {}
            for side in order:
                load = os.getloadavg()[0]
                if side == "trl":
                    spec = {**settings, "model": str(model), "seed": seed}
                    runs[side] = run_trl(spec, out / f"trl-{i}", args.trl_threads, args.timeout)
                else:
                    runs[side] = run_kuberl(
                        doc,
                        model,
                        rl_steps,
                        every,
                        out / f"kuberl-{i}",
                        args.timeout,
                        args.rollout_replicas,
                        seed,
                    )
                runs[side]["load"] = [round(load, 1), round(os.getloadavg()[0], 1)]
                print(
                    f"pair {i + 1}/{repeat} {side}: {runs[side]['wall_seconds']:.1f} s "
                    f"(load {runs[side]['load']})",
                    file=sys.stderr,
                )
            trl_curve = ev.curve(runs["trl"]["snapshots"], start_acc)
            kub_curve = ev.curve(runs["kuberl"]["snapshots"], start_acc)
            pair = figures(runs["trl"], runs["kuberl"], trl_curve, kub_curve, goal=goal)
            pair["order"] = list(order)
            pair["seed"] = seed
            pairs.append(pair)
        result = {
            "benchmark": "vs_trl_long" if long else "vs_trl",
            "task": args.task,
            "quick": args.quick,
            **summarize(pairs, goal),
            "settings": {
                k: settings[k]
                for k in (
                    "rl_steps",
                    "sft_steps",
                    "group_size",
                    "groups_per_step",
                    "lr",
                    "temperature",
                    "max_new_tokens",
                    "eval_every",
                )
            },
            "rollout_replicas": args.rollout_replicas
            or doc.get("job", {}).get("local", {}).get("rollout_replicas", 2),
            "eval": "greedy, 200 held-out questions, gsm8k verifier",
            "start_accuracy": start_acc,
            "warm_start_seconds": round(warm_seconds, 1),
            "benchmark_seconds": round(time.time() - started, 1),
            "machine": where,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "pairs": pairs,
        }
    finally:
        if args.out is None and not args.keep:
            shutil.rmtree(out, ignore_errors=True)
        elif args.out is None:
            print(f"work folder kept: {out}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
