"""One caller's samples cannot hold another caller's scores (docs/security.md, reward).

A real reward service with one worker process. A batch of catastrophic-backtracking regexes used
to hold that worker for a per-sample timeout each (26 s for a handful) while every other caller
waited; RE2 matches them in linear time. A batch of verifiers that really hang still costs its
timeouts, but concurrent batches share the workers round-robin, so the other caller's sample is
scored after the first timeout, not after all of them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kuberl.api.reward.v1 import reward_pb2, reward_pb2_grpc
from kuberl.common.channels import sync_channel
from tests.integration.test_reward_service import PLUGINS, reward_job
from tests.support import ServiceProcess

#: Python's `re` needs about 2**40 steps to fail this match.
CATASTROPHIC = {"regex": r"(a+)+$"}
HOSTILE_RESPONSE = "a" * 40 + "b"


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[reward_pb2_grpc.RewardServiceStub]:
    tmp = tmp_path_factory.mktemp("reward")
    job = reward_job(
        tmp,
        workers=1,
        timeout_seconds=1,
        custom={"hangs": {"function": f"{PLUGINS}:hangs"}},
    )
    with ServiceProcess.kuberl("reward", job, tmp) as proc:
        proc.wait_serving(timeout=120)
        with sync_channel(proc.address) as channel:
            yield reward_pb2_grpc.RewardServiceStub(channel)


def _score(stub: reward_pb2_grpc.RewardServiceStub, samples: list[reward_pb2.Sample]) -> list:
    return list(stub.Score(reward_pb2.ScoreRequest(samples=samples), timeout=120).scores)


def test_catastrophic_regexes_are_matched_in_linear_time(
    stub: reward_pb2_grpc.RewardServiceStub,
) -> None:
    hostile = [
        reward_pb2.Sample(
            sample_id=f"h{i}",
            response=HOSTILE_RESPONSE,
            metadata_json=json.dumps(CATASTROPHIC),
            verifiers=["regex"],
        )
        for i in range(8)
    ]
    started = time.monotonic()
    scores = _score(stub, hostile)
    seconds = time.monotonic() - started
    assert ({(s.reward, s.error) for s in scores}, seconds < 0.9) == ({(0.0, "")}, True)


def test_a_regex_re2_cannot_match_in_linear_time_is_the_samples_error(
    stub: reward_pb2_grpc.RewardServiceStub,
) -> None:
    (score,) = _score(
        stub,
        [
            reward_pb2.Sample(
                sample_id="b",
                response="aa",
                metadata_json=json.dumps({"regex": r"(a)\1"}),
                verifiers=["regex"],
            )
        ],
    )
    assert "no backreferences or lookaround" in score.error


def test_a_batch_that_hangs_does_not_hold_another_callers_sample_behind_it(
    stub: reward_pb2_grpc.RewardServiceStub,
) -> None:
    hanging = [reward_pb2.Sample(sample_id=f"x{i}", verifiers=["hangs"]) for i in range(4)]
    finished: dict[str, float] = {}

    def call(name: str, samples: list[reward_pb2.Sample]) -> None:
        try:
            _score(stub, samples)
        except grpc.RpcError as exc:  # the assertion below shows it as never finished
            print(f"{name}: {exc}")
            return
        finished[name] = time.monotonic()

    hostile = threading.Thread(target=call, args=("hostile", hanging))
    hostile.start()
    time.sleep(0.3)  # its samples are queued (and the first chunk is running) first
    call("honest", [reward_pb2.Sample(sample_id="ok", response="#### 1", answer="#### 1")])
    hostile.join(120)
    assert set(finished) == {"hostile", "honest"}
    assert finished["honest"] < finished["hostile"]


def test_the_format_pattern_of_the_job_may_use_what_re2_lacks(tmp_path: Path) -> None:
    from kuberl.reward.verifiers.format import match_score

    assert match_score(r"(a)\1\Z", "xaa").score == 1.0
