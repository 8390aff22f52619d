"""The reward service as it runs in production: `kuberl serve reward` in a subprocess, called
over gRPC. A 1,000-sample batch, ListVerifiers, bad input rejected with INVALID_ARGUMENT and
counted, Prometheus metrics, and the `kuberl reward score` CLI on JSONL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from kuberl.api.common.v1 import trajectory_pb2
from kuberl.api.reward.v1 import reward_pb2, reward_pb2_grpc
from kuberl.common.channels import sync_channel
from kuberl.common.trajectory import encode_array
from tests.support import REPO, ServiceProcess

GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")
PLUGINS = "tests.unit.reward_plugins"


def reward_job(tmp_path: Path, **reward: object) -> Path:
    """A job file for the reward service on loopback with free ports."""
    section = {
        "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
        "verifiers": {"gsm8k": 1.0},
        "custom": {"raises": {"function": f"{PLUGINS}:raises"}},
        "timeout_seconds": 8,
        "workers": 2,
        **reward,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"reward": section}))
    return path


class RewardClient:
    def __init__(self, proc: ServiceProcess, channel: grpc.Channel) -> None:
        self.proc = proc
        self.stub = reward_pb2_grpc.RewardServiceStub(channel)

    def score(self, *samples: reward_pb2.Sample, timeout: float = 60) -> list:
        return list(
            self.stub.Score(reward_pb2.ScoreRequest(samples=samples), timeout=timeout).scores
        )

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.proc.metrics_port}/metrics"
        return urllib.request.urlopen(url, timeout=10).read().decode()


@pytest.fixture(scope="module")
def reward(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RewardClient]:
    tmp = tmp_path_factory.mktemp("reward")
    with ServiceProcess.kuberl("reward", reward_job(tmp), tmp) as proc:
        proc.wait_serving(timeout=120)
        with sync_channel(proc.address) as channel:
            yield RewardClient(proc, channel)


def _gsm8k_rows(n: int) -> list[dict[str, str]]:
    return [json.loads(line) for line in GSM8K_TEST.read_text().splitlines()[:n]]


def test_a_batch_of_1000_samples_is_scored_in_order(reward: RewardClient) -> None:
    rows = _gsm8k_rows(1000)
    samples = []
    for i, row in enumerate(rows):
        body, final = row["answer"].rsplit("####", 1)
        wrong = f"{body}#### {int(final.replace(',', '')) + 7}"
        samples.append(
            reward_pb2.Sample(
                sample_id=f"s{i}",
                prompt=row["question"],
                response=row["answer"] if i % 2 == 0 else wrong,
                answer=row["answer"],
            )
        )
    scores = reward.score(*samples, timeout=120)
    expected = [(f"s{i}", 1.0 if i % 2 == 0 else 0.0, "") for i in range(1000)]
    assert [(s.sample_id, s.reward, s.error) for s in scores] == expected


def test_list_verifiers_names_builtins_and_custom_ones_with_weights(
    reward: RewardClient,
) -> None:
    listed = reward.stub.ListVerifiers(reward_pb2.ListVerifiersRequest(), timeout=10).verifiers
    assert {v.name: v.weight for v in listed} == {
        "gsm8k": 1.0,
        "math": 0.0,
        "code": 0.0,
        "format": 0.0,
        "regex": 0.0,
        "length": 0.0,
        "raises": 0.0,
    }


def test_the_sample_shape_rollout_sends_is_scored_with_every_field(reward: RewardClient) -> None:
    tokens = encode_array(np.arange(90, dtype=np.int32))
    sample = reward_pb2.Sample(
        sample_id="r1",
        prompt="What is 6*7?",
        response="<think>6*7</think> The answer is 42.",
        response_token_ids=tokens,
        answer="#### 42",
        metadata_json=json.dumps({"source": "unit"}),
        finish_reason=trajectory_pb2.FINISH_REASON_STOP,
        verifiers=["gsm8k", "format=0.5", "length"],
    )
    (score,) = reward.score(sample)
    # length: max_new_tokens 256 and no buffer, so 90 tokens are not penalised.
    assert (score.reward, dict(score.breakdown)) == (
        1.5,
        {"gsm8k": 1.0, "format": 1.0, "length": 0.0, "length/tokens": 90.0},
    )


def test_a_verifier_that_raises_gives_the_fallback_and_the_batch_succeeds(
    reward: RewardClient,
) -> None:
    ok = reward_pb2.Sample(sample_id="ok", response="#### 1", answer="#### 1")
    bad = reward_pb2.Sample(sample_id="bad", response="#### 1", verifiers=["raises"])
    scores = reward.score(ok, bad)
    assert [(s.sample_id, s.reward, s.error) for s in scores] == [
        ("ok", 1.0, ""),
        ("bad", 0.0, "raises: exception: RuntimeError: reward function exploded"),
    ]


@pytest.mark.parametrize(
    ("sample", "reason", "message"),
    [
        (reward_pb2.Sample(sample_id="u", verifiers=["nope"]), "unknown_verifier", "'nope'"),
        (reward_pb2.Sample(sample_id="m", metadata_json="[1]"), "bad_metadata", "JSON object"),
        (reward_pb2.Sample(sample_id="j", metadata_json="{x"), "bad_metadata", "valid JSON"),
        # 101 levels parse but are refused; 5,000 levels and a 5,000-digit integer do not parse
        # (RecursionError, ValueError). Once, 976 levels hung a pool slot for good.
        (
            reward_pb2.Sample(sample_id="n", metadata_json='{"a":' + "[" * 100 + "]" * 100 + "}"),
            "bad_metadata",
            "nested 101 levels deep; at most 100",
        ),
        (
            reward_pb2.Sample(sample_id="r", metadata_json="[" * 5000 + "]" * 5000),
            "bad_metadata",
            "valid JSON",
        ),
        (
            reward_pb2.Sample(sample_id="i", metadata_json='{"a": ' + "7" * 5000 + "}"),
            "bad_metadata",
            "valid JSON",
        ),
        (
            reward_pb2.Sample(
                sample_id="t", response_token_ids=encode_array(np.ones(3, np.float32))
            ),
            "bad_tokens",
            "integer tensor",
        ),
        (
            reward_pb2.Sample(
                sample_id="d",
                response_token_ids=trajectory_pb2.Tensor(dtype="int32", data=b"\x00" * 5),
            ),
            "bad_tokens",
            "sample 'd' token ids",
        ),
    ],
)
def test_bad_input_is_rejected_with_invalid_argument_and_counted(
    reward: RewardClient, sample: reward_pb2.Sample, reason: str, message: str
) -> None:
    line = f'kuberl_reward_rejected_total{{reason="{reason}"}}'

    def count() -> float:
        found = [ln for ln in reward.metrics().splitlines() if ln.startswith(line)]
        return float(found[0].split()[-1]) if found else 0.0

    before = count()
    with pytest.raises(grpc.RpcError) as err:
        reward.score(sample)
    assert (err.value.code(), message in err.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        True,
    )
    assert count() == before + 1


def test_scores_errors_and_latency_are_exported_as_prometheus_metrics(
    reward: RewardClient,
) -> None:
    reward.score(
        reward_pb2.Sample(sample_id="m1", response="#### 2", answer="#### 2"),
        reward_pb2.Sample(sample_id="m2", response="x", verifiers=["raises"]),
    )
    text = reward.metrics()
    wanted = [
        'kuberl_reward_score_bucket{le="1.0",verifier="gsm8k"}',
        'kuberl_reward_errors_total{reason="exception",verifier="raises"}',
        'kuberl_reward_verifier_seconds_count{verifier="gsm8k"}',
        'kuberl_reward_samples_total{outcome="fallback"}',
        'kuberl_reward_sandbox_isolated{aspect="network"}',
    ]
    assert [w for w in wanted if w not in text] == []


def test_the_cli_scores_jsonl_from_stdin_one_line_per_input(tmp_path: Path) -> None:
    lines = [
        {"id": "a", "response": "#### 72", "answer": "#### 72"},
        {"response": "The answer is 7.", "answer": "72"},
        {"respone": "typo"},
        {"id": 4, "response": "<think>..</think> 1", "answer": "1"},
    ]
    stdin = "\n".join(json.dumps(line) for line in lines) + "\n"
    done = subprocess.run(
        [sys.executable, "-m", "kuberl.cli", "reward", "score", "-v", "gsm8k", "-v", "format=0.5"],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    out = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 1, done.stderr  # one bad line
    assert [(o.get("id"), o.get("reward"), o.get("line")) for o in out] == [
        ("a", 1.0, None),
        (None, 0.0, None),
        (None, None, 3),
        ("4", 1.5, None),
    ]
    assert out[1]["details"] == "gsm8k: read 7 (answer); gold 72"


def test_the_cli_scores_with_the_custom_verifiers_and_settings_of_a_job_file(
    tmp_path: Path,
) -> None:
    config = reward_job(
        tmp_path,
        custom={"exact": {"function": f"{PLUGINS}:exact_match"}},
        format_pattern=r"^OK\b",
    )
    lines = [
        {"id": "a", "response": "OK 72", "answer": "OK 72"},
        {"id": "b", "response": "72", "answer": "OK 72"},
    ]
    done = subprocess.run(
        [
            *(sys.executable, "-m", "kuberl.cli", "reward", "score", "--config", str(config)),
            *("-v", "exact", "-v", "format=0.5"),
        ],
        input="".join(json.dumps(line) + "\n" for line in lines),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    out = [json.loads(line) for line in done.stdout.splitlines()]
    assert (done.returncode, [(o["id"], o["reward"], o["breakdown"]) for o in out]) == (
        0,
        [("a", 1.5, {"exact": 1.0, "format": 1.0}), ("b", 0.0, {"exact": 0.0, "format": 0.0})],
    ), done.stderr


def test_the_cli_refuses_an_unknown_verifier_before_reading_input() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kuberl.cli", "reward", "score", "--verifier", "nope"],
        input="",
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert (done.returncode, "unknown verifier 'nope'" in done.stderr) == (2, True)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append(int(entry))
    return found


def test_sigterm_stops_the_service_and_its_worker_processes(tmp_path: Path) -> None:
    with ServiceProcess.kuberl("reward", reward_job(tmp_path), tmp_path) as proc:
        proc.wait_serving(timeout=120)
        workers = _children(proc.proc.pid)
        code = proc.stop()
    alive = [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    assert (len(workers) >= 2, code, alive) == (True, 0, [])
