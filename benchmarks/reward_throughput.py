"""Reward throughput: samples/s of `gsm8k` and `code` through the gRPC service vs. direct calls.

Baselines, measured in the same run on the same machine:
- gsm8k: `kuberl.reward.verifiers.gsm8k.score` called in a loop in this process;
- code: `Sandbox.run` + the code verdict awaited in this process with the same sandbox settings
  (so both sides pay for the same isolated processes; the difference is the service around it).

The service is `kuberl serve reward` in a subprocess (its default 2 worker processes), fed
batches of `--batch` samples with `--inflight` calls in flight, the way rollout replicas call it.
Samples are GSM8K test gold solutions (half with the final number changed) and short programs
(`print(int(input()) * 2)` style, 3 stdin/stdout tests each, a quarter of them wrong).

    .venv/bin/python benchmarks/reward_throughput.py [--gsm8k N] [--code N]

The last line printed is one JSON object with both figures, their ratios and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from kuberl.api.reward.v1 import reward_pb2, reward_pb2_grpc
from kuberl.common.channels import sync_channel, wait_serving
from kuberl.common.config import SandboxConfig
from kuberl.common.sandbox import Sandbox
from kuberl.reward.sample import RewardSample
from kuberl.reward.verifiers import code, gsm8k

GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")
REPO = Path(__file__).resolve().parents[1]


def gsm8k_samples(n: int) -> list[RewardSample]:
    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines()]
    samples = []
    for i in range(n):
        row = rows[i % len(rows)]
        body, final = row["answer"].rsplit("####", 1)
        wrong = f"{body}#### {int(final.replace(',', '')) + 1}"
        response = row["answer"] if i % 2 == 0 else wrong
        samples.append(RewardSample(str(i), row["question"], response, row["answer"]))
    return samples


def code_samples(n: int) -> list[RewardSample]:
    samples = []
    for i in range(n):
        k = i % 5 + 2
        body = f"print(int(input()) * {k})" if i % 4 else f"print(int(input()) + {k})"
        tests = [{"input": f"{x}\n", "output": f"{x * k}\n"} for x in (1, 7, 12)]
        samples.append(
            RewardSample(str(i), response=f"```python\n{body}\n```", metadata={"tests": tests})
        )
    return samples


def direct_gsm8k(samples: list[RewardSample]) -> tuple[float, float]:
    started = time.perf_counter()
    total = sum(gsm8k.score(s).score for s in samples)
    return len(samples) / (time.perf_counter() - started), total


async def _direct_code(samples: list[RewardSample], sandbox: SandboxConfig) -> float:
    box = Sandbox(sandbox, setting="reward.sandbox")

    async def one(sample: RewardSample) -> float:
        run = await box.run(
            code.extract_code(sample.response), code.parse_tests(sample.metadata), 30.0
        )
        return code.verdict(run.results).score

    return sum(await asyncio.gather(*[one(s) for s in samples]))


def direct_code(samples: list[RewardSample], sandbox: SandboxConfig) -> tuple[float, float]:
    started = time.perf_counter()
    total = asyncio.run(_direct_code(samples, sandbox))
    return len(samples) / (time.perf_counter() - started), total


def to_proto(sample: RewardSample, verifier: str) -> reward_pb2.Sample:
    return reward_pb2.Sample(
        sample_id=sample.sample_id,
        prompt=sample.prompt,
        response=sample.response,
        answer=sample.answer,
        metadata_json=json.dumps(sample.metadata),
        verifiers=[verifier],
    )


def through_service(
    address: str, samples: list[RewardSample], verifier: str, batch: int, inflight: int
) -> tuple[float, float]:
    requests = [
        reward_pb2.ScoreRequest(samples=[to_proto(s, verifier) for s in samples[i : i + batch]])
        for i in range(0, len(samples), batch)
    ]
    with sync_channel(address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        stub.ListVerifiers(reward_pb2.ListVerifiersRequest(), timeout=10)  # connect first
        started = time.perf_counter()
        with ThreadPoolExecutor(inflight) as pool:
            replies = list(pool.map(lambda r: stub.Score(r, timeout=600), requests))
        elapsed = time.perf_counter() - started
    errors = [s.error for reply in replies for s in reply.scores if s.error]
    if errors:
        raise RuntimeError(f"{len(errors)} samples failed, e.g. {errors[0]}")
    return len(samples) / elapsed, sum(s.reward for reply in replies for s in reply.scores)


def start_service(workdir: Path, sandbox: SandboxConfig) -> tuple[subprocess.Popen, str]:
    job = workdir / "job.yaml"
    reward = {
        "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
        "verifiers": {"gsm8k": 1.0},
        "sandbox": sandbox.model_dump(),
        "timeout_seconds": 30,
    }
    job.write_text(yaml.safe_dump({"reward": reward}))
    ports = workdir / "ports.json"
    log = (workdir / "reward.log").open("wb")
    command = [sys.executable, "-m", "kuberl.cli", "serve", "reward", "--config", str(job)]
    proc = subprocess.Popen(
        [*command, "--port-file", str(ports)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "KUBERL_LOG_LEVEL": "warning"},
    )
    deadline = time.monotonic() + 120
    while not ports.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"reward service did not start; see {workdir / 'reward.log'}")
        time.sleep(0.05)
    address = f"127.0.0.1:{json.loads(ports.read_text())['port']}"
    wait_serving(address, timeout=120)
    return proc, address


def machine() -> dict[str, object]:
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model or platform.processor(),
        "cores": os.cpu_count(),
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "euid": os.geteuid(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gsm8k", type=int, default=4000, help="gsm8k samples")
    parser.add_argument("--code", type=int, default=64, help="code samples")
    parser.add_argument("--batch", type=int, default=128, help="samples per Score call")
    parser.add_argument("--inflight", type=int, default=4, help="Score calls in flight")
    args = parser.parse_args()
    box = SandboxConfig(max_concurrent=2, wall_seconds=10, cpu_seconds=5)
    info = machine()
    g_samples, c_samples = gsm8k_samples(args.gsm8k), code_samples(args.code)

    g_direct, g_direct_sum = direct_gsm8k(g_samples)
    c_direct, c_direct_sum = direct_code(c_samples, box)
    with tempfile.TemporaryDirectory(prefix="kuberl-bench-") as tmp:
        proc, address = start_service(Path(tmp), box)
        try:
            g_service, g_service_sum = through_service(
                address, g_samples, "gsm8k", args.batch, args.inflight
            )
            c_batch = max(1, min(args.batch, args.code // args.inflight))
            c_service, c_service_sum = through_service(
                address, c_samples, "code", c_batch, args.inflight
            )
        finally:
            proc.terminate()
            proc.wait(30)
    if (g_direct_sum, c_direct_sum) != (g_service_sum, c_service_sum):
        raise RuntimeError(
            f"service and direct rewards differ: gsm8k {g_service_sum} vs {g_direct_sum}, "
            f"code {c_service_sum} vs {c_direct_sum}"
        )
    result = {
        "benchmark": "reward_throughput",
        "gsm8k": {
            "samples": args.gsm8k,
            "direct_samples_per_s": round(g_direct, 1),
            "service_samples_per_s": round(g_service, 1),
            "service_over_direct": round(g_service / g_direct, 3),
        },
        "code": {
            "samples": args.code,
            "tests_per_sample": 3,
            "direct_samples_per_s": round(c_direct, 2),
            "service_samples_per_s": round(c_service, 2),
            "service_over_direct": round(c_service / c_direct, 3),
        },
        "service": {"workers": 2, "sandbox_slots": box.max_concurrent, "batch": args.batch},
        "machine": info,
    }
    print(f"gsm8k: direct {g_direct:.0f}/s, service {g_service:.0f}/s")
    print(f"code:  direct {c_direct:.2f}/s, service {c_service:.2f}/s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
