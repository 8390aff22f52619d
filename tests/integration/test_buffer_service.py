"""The buffer as it runs in production: `kuberl serve buffer` in subprocesses on a real embedded
Redis, driven over gRPC by concurrent clients, by a rollout client and a trainer killed with
SIGKILL, through a Redis restart, and as two replicas serving one job."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.common.buffer_client import BufferStub, encode_put
from kuberl.common.redis_server import EmbeddedRedis
from tests.integration.buffer_support import (
    GROUP_SIZE,
    REJECTIONS,
    Client,
    corrupt_put,
    group_for,
    start_buffer,
    write_job,
)
from tests.support import REPO, ServiceProcess

ACCEPTED, DUPLICATE = bpb.PUT_STATUS_ACCEPTED, bpb.PUT_STATUS_DUPLICATE


@pytest.fixture(scope="module")
def shared(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServiceProcess, Path]]:
    """One buffer process for tests that only reject requests or use prompts of their own."""
    tmp = tmp_path_factory.mktemp("shared")
    config = write_job(tmp, redis_url, prompts=32)
    with start_buffer(config, tmp) as proc, Client(proc.address) as client:
        client.lease(1, consumer="setup")  # queues epoch 0
        yield proc, config


@contextmanager
def _stand_in(*args: str) -> Iterator[tuple[subprocess.Popen[bytes], dict]]:
    """A rollout/trainer stand-in (tests/integration/buffer_support.py) that does one call, reports
    it, and then hangs until the test kills it; it is killed at exit whatever happens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.buffer_support", *args],
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        yield proc, json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(10)


def _metrics(proc: ServiceProcess) -> str:
    url = f"http://127.0.0.1:{proc.metrics_port}/metrics"
    return urllib.request.urlopen(url, timeout=10).read().decode()


def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()  # type: ignore[operator]
    return err.value.code()


def _run_rollout_clients(addresses: list[str], clients: int) -> tuple[list, Counter]:
    """`clients` threads (spread over addresses) lease and complete until the data is exhausted.
    Returns the prompts seen leased by two clients at once, and how often each was accepted."""
    held: dict[tuple[str, int], int] = {}
    overlaps: list[tuple[str, int]] = []
    accepted: Counter[tuple[str, int]] = Counter()
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            with Client(addresses[i % len(addresses)]) as client:
                while not (resp := client.lease(3, consumer=f"rollout-{i}")).exhausted:
                    if not resp.prompts:
                        time.sleep(0.02)
                        continue
                    keys = [(p.prompt_id, p.epoch) for p in resp.prompts]
                    with lock:
                        overlaps.extend(k for k in keys if k in held)
                        held.update(dict.fromkeys(keys, i))
                    statuses = client.complete(resp.prompts)
                    with lock:
                        for k, status in zip(keys, statuses, strict=True):
                            del held[k]
                            accepted[k] += status == ACCEPTED
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    return overlaps, accepted


def test_eight_concurrent_clients_never_hold_the_same_prompt_at_once(
    redis_url: str, tmp_path: Path
) -> None:
    config = write_job(tmp_path, redis_url, prompts=40, epochs=2, requeue_stale=False)
    with start_buffer(config, tmp_path) as proc:
        overlaps, accepted = _run_rollout_clients([proc.address], clients=8)
    expected = {(f"train:{i}", e) for i in range(40) for e in range(2)}
    assert (overlaps, set(accepted), set(accepted.values())) == ([], expected, {1})


def test_an_expired_lease_is_redelivered_and_the_late_put_is_a_duplicate(
    redis_url: str, tmp_path: Path
) -> None:
    config = write_job(tmp_path, redis_url, prompts=4, lease_timeout_seconds=1)
    with start_buffer(config, tmp_path) as proc, Client(proc.address) as client:
        slow = client.lease(2, consumer="slow").prompts
        time.sleep(1.5)
        fast = client.lease(2, consumer="fast").prompts
        fast_statuses = client.complete(fast)
        late = _code(lambda: client.complete(slow[:1]))
    assert (
        [p.prompt_id for p in fast],
        [p.delivery_count for p in fast],
        fast_statuses,
        late,
    ) == ([p.prompt_id for p in slow], [2, 2], [ACCEPTED] * 2, grpc.StatusCode.ALREADY_EXISTS)


def test_a_rollout_client_killed_mid_lease_has_its_prompts_finished_by_another(
    redis_url: str, tmp_path: Path
) -> None:
    config = write_job(tmp_path, redis_url, prompts=6, lease_timeout_seconds=1, requeue_stale=False)
    with start_buffer(config, tmp_path) as proc:
        with _stand_in("lease", proc.address, "3", "victim") as (victim, report):
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
        taken = report["prompts"]
        deliveries: dict[str, int] = {}
        with Client(proc.address) as client:
            while not (resp := client.lease(6, consumer="survivor")).exhausted:
                if not resp.prompts:
                    time.sleep(0.1)
                    continue
                deliveries.update({p.prompt_id: p.delivery_count for p in resp.prompts})
                assert client.complete(resp.prompts) == [ACCEPTED] * len(resp.prompts)
    assert (len(taken), sorted(deliveries), {deliveries[p] for p in taken}) == (
        3,
        [f"train:{i}" for i in range(6)],
        {2},
    )


@pytest.mark.parametrize("defect", sorted(REJECTIONS))
def test_every_invalid_put_is_answered_invalid_argument_and_the_service_keeps_serving(
    shared: tuple[ServiceProcess, Path], defect: str
) -> None:
    proc, _ = shared
    groups, leases = corrupt_put(defect)
    with Client(proc.address) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.put(groups, leases)
        alive = client.stats().job
    assert (err.value.code(), REJECTIONS[defect] in err.value.details(), bool(alive)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        True,
        True,
    ), err.value.details()


def test_duplicate_puts_are_answered_and_counted_and_rejections_are_in_metrics(
    shared: tuple[ServiceProcess, Path],
) -> None:
    proc, _ = shared
    with Client(proc.address) as client:
        prompts = client.lease(2, consumer="dup").prompts
        first = client.complete(prompts)
        single = _code(lambda: client.complete(prompts[:1]))
        both = client.complete(prompts)
        counters = client.stats().counters
        with pytest.raises(grpc.RpcError):
            client.put([group_for(prompts[0], size=1)])
    text = _metrics(proc)
    assert (first, single, both, counters["train:duplicate"]) == (
        [ACCEPTED] * 2,
        grpc.StatusCode.ALREADY_EXISTS,
        [DUPLICATE] * 2,
        3,
    )
    assert 'kuberl_buffer_groups_put_total{kind="train",result="duplicate"} 3.0' in text
    assert 'kuberl_buffer_rejections_total{method="PutTrajectories",reason="invalid_group"}' in text


def test_stats_cli_prints_the_job_state_as_a_table(shared: tuple[ServiceProcess, Path]) -> None:
    proc, config = shared
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kuberl.cli",
            "buffer",
            "stats",
            "--config",
            str(config),
            "--address",
            proc.address,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    ).stdout
    rows = {
        cells[0]: cells[1]
        for line in out.splitlines()
        if len(cells := [c.strip() for c in line.strip("|").split("|")]) == 2
    }
    assert (rows["prompts_total"], rows["epoch"], rows["exhausted"]) == ("32", "0", "False")


def test_stats_cli_with_redis_reads_the_job_state_when_no_buffer_is_running(
    redis_url: str, tmp_path: Path
) -> None:
    config = write_job(tmp_path, redis_url, prompts=5)
    with start_buffer(config, tmp_path) as proc, Client(proc.address) as client:
        client.complete(client.lease(3).prompts)
    out = subprocess.run(
        [
            *(sys.executable, "-m", "kuberl.cli", "buffer", "stats"),
            *("--config", str(config), "--redis", "--json"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    ).stdout
    stats = json.loads(out)
    assert (
        stats["prompts_total"],
        stats["cursor"],
        stats["groups_pending"],
        stats["counters"]["train:accepted"],
        stats["exhausted"],
    ) == (5, 3, 3, 3, False)


def test_stats_cli_with_redis_says_when_no_buffer_has_served_the_job(
    redis_url: str, tmp_path: Path
) -> None:
    # A job name this Redis has no streams for (a typo, or before any buffer started): the
    # command printed a traceback of XPENDING's "no such key".
    config = write_job(tmp_path, redis_url, prompts=5, job=f"never-served-{uuid.uuid4().hex[:6]}")
    done = subprocess.run(
        [
            *(sys.executable, "-m", "kuberl.cli", "buffer", "stats"),
            *("--config", str(config), "--redis"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert (done.returncode, "no buffer state for job" in done.stderr) == (1, True), done.stderr
    assert "Traceback" not in done.stderr


def test_stale_groups_are_dropped_counted_and_their_prompts_requeued(
    redis_url: str, tmp_path: Path
) -> None:
    config = write_job(tmp_path, redis_url, prompts=2)
    with start_buffer(config, tmp_path) as proc, Client(proc.address) as client:
        old, new = client.lease(2).prompts
        client.put(
            [group_for(old, version=1), group_for(new, version=3)], [old.lease_id, new.lease_id]
        )
        batch = client.get(2, max_staleness=1, version=3)
        requeued = client.lease(2).prompts
        text = _metrics(proc)
    assert ([g.prompt_id for g in batch.groups], dict(batch.dropped)) == (
        [new.prompt_id],
        {"stale": 1},
    )
    assert ([(p.prompt_id, p.epoch) for p in requeued]) == [(old.prompt_id, old.epoch)]
    assert 'kuberl_buffer_groups_dropped_total{kind="train",reason="stale"} 1.0' in text


def test_a_trainer_killed_before_ack_gets_the_same_batch_again_and_never_trains_it_twice(
    redis_url: str, tmp_path: Path
) -> None:
    config = write_job(tmp_path, redis_url, prompts=4, batch_ack_timeout_seconds=1)
    with start_buffer(config, tmp_path) as proc, Client(proc.address) as client:
        client.complete(client.lease(4).prompts)
        with _stand_in("get", proc.address, "3") as (trainer, crashed):
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(10)
        time.sleep(1.5)  # past batch_ack_timeout_seconds
        again = client.get(3)
        acks = [client.ack(again.batch_id).already_acked, client.ack(again.batch_id).already_acked]
        rest = client.get(3)
        client.ack(rest.batch_id)
        end = client.get(3)
    assert (again.batch_id, again.redelivered, [g.prompt_id for g in again.groups]) == (
        crashed["batch_id"],
        True,
        crashed["prompts"],
    )
    assert (acks, len(rest.groups), rest.redelivered, len(end.groups), end.exhausted) == (
        [False, True],
        1,
        False,
        0,
        True,
    )
    assert {g.prompt_id for g in rest.groups}.isdisjoint(crashed["prompts"])


def test_groups_dropped_while_a_batch_waits_free_their_place_for_new_ones_at_once(
    redis_url: str, tmp_path: Path
) -> None:
    # max_inflight_groups 4 and dynamic sampling: of the first four groups two have rewards that
    # all agree and are dropped. While GetBatch(4) waits for two more, those two must no longer
    # count against backpressure, or no rollout could lease the prompts it waits for.
    config = write_job(tmp_path, redis_url, prompts=8, max_inflight_groups=4, dynamic_sampling=True)
    with start_buffer(config, tmp_path) as proc, Client(proc.address) as client:
        first = list(client.lease(4).prompts)
        same = [1.0] * GROUP_SIZE
        groups = [group_for(p, rewards=same if i < 2 else None) for i, p in enumerate(first)]
        client.put(groups, [p.lease_id for p in first])
        got: dict[str, bpb.GetBatchResponse] = {}
        getter = threading.Thread(target=lambda: got.update(batch=client.get(4, wait=20)))
        started = time.monotonic()
        getter.start()
        # Once GetBatch has dropped the two (it then waits for two more), their places are free.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (
            client.stats().counters.get("train:dropped:zero_variance", 0) < 2
        ):
            time.sleep(0.05)
        more = list(client.lease(4).prompts)
        client.complete(more)
        getter.join(30)
        seconds = time.monotonic() - started
    batch = got["batch"]
    assert (len(more), len(batch.groups), dict(batch.dropped)) == (2, 4, {"zero_variance": 2})
    assert seconds < 10, f"the batch waited {seconds:.1f}s for groups no rollout could lease"


def test_get_batch_acknowledges_the_previous_batch_in_the_same_call(
    redis_url: str, tmp_path: Path
) -> None:
    # The deadline must not pass between `second` and `third` (a stall of the machine would
    # re-deliver `second` early), only during the sleep below.
    config = write_job(tmp_path, redis_url, prompts=6, batch_ack_timeout_seconds=3)
    with start_buffer(config, tmp_path) as proc, Client(proc.address) as client:
        client.complete(client.lease(6).prompts)
        first = client.get(2)
        # An unknown batch: NOT_FOUND, and nothing is taken (the next call gets those groups).
        unknown = _code(lambda: client.get(2, ack="train-" + "0" * 32))
        second = client.get(2, ack=first.batch_id)
        # A repeat (a retried call whose reply was lost) says it was acknowledged before.
        third = client.get(2, ack=first.batch_id)
        time.sleep(3.5)  # past batch_ack_timeout_seconds: only un-acked batches come back
        again = client.get(2, ack=third.batch_id)
        end = client.get(2, ack=second.batch_id)
        stats = client.stats()
        text = _metrics(proc)
    taken = [g.prompt_id for b in (first, second, third) for g in b.groups]
    assert (unknown, len(set(taken)), second.ack_already_acked, third.ack_already_acked) == (
        grpc.StatusCode.NOT_FOUND,
        6,
        False,
        True,
    )
    # `second` was never acknowledged when the deadline passed: it is the one re-delivered.
    assert (again.batch_id, again.redelivered, again.ack_already_acked) == (
        second.batch_id,
        True,
        False,
    )
    counters = stats.counters
    assert (len(end.groups), end.exhausted, stats.batches_unacked) == (0, True, 0)
    assert (counters["train:acked_batches"], counters["train:trained_groups"]) == (3, 6)
    assert 'kuberl_buffer_acks_total{kind="train",result="acked"} 3.0' in text
    assert 'kuberl_buffer_acks_total{kind="train",result="already_acked"} 1.0' in text


def test_held_batches_leave_the_window_stay_until_acknowledged_and_come_back_when_reopened(
    redis_url: str, tmp_path: Path
) -> None:
    # A trainer that acknowledges after its checkpoints holds each trained batch until then.
    # Held groups must not count against max_inflight_groups (rollout goes on) nor keep the data
    # from ending, must not come back on the ack timeout (the trainer is alive), must stay until
    # acknowledged, and must all come back, oldest first, to a restarted trainer.
    config = write_job(
        tmp_path, redis_url, prompts=6, max_inflight_groups=4, batch_ack_timeout_seconds=1
    )
    with start_buffer(config, tmp_path) as proc, Client(proc.address) as client:
        client.complete(client.lease(4).prompts)
        full = _code(lambda: client.lease(1))
        first = client.get(2)
        second = client.get(2, ack=first.batch_id, hold=True)
        rest = list(client.lease(4).prompts)  # first's two groups left the window
        client.complete(rest)
        time.sleep(1.5)  # past batch_ack_timeout_seconds: held batches must not come back
        third = client.get(2, ack=second.batch_id, hold=True)
        end = client.get(2, ack=third.batch_id, hold=True)
        held = client.stats()
        rehold = client.ack(first.batch_id, hold=True).already_acked
        unknown = _code(lambda: client.ack("train-" + "0" * 32, hold=True))
        committed = client.ack(first.batch_id).already_acked  # the checkpoint had its step
        # The trainer restarts: its first GetBatch asks the held batches back.
        again = [client.get(2, reopen=True)]
        again.append(client.get(2, ack=again[0].batch_id))
        last = client.get(2, ack=again[1].batch_id)
        stats = client.stats()
        text = _metrics(proc)
    assert (full, len(rest), [len(b.groups) for b in (first, second, third)]) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        2,
        [2, 2, 2],
    )
    assert (third.redelivered, len(end.groups), end.exhausted) == (False, 0, True)
    assert (held.batches_held, held.groups_held, held.groups_pending, held.batches_unacked) == (
        3,
        6,
        0,
        0,
    )
    assert (rehold, unknown, committed) == (True, grpc.StatusCode.NOT_FOUND, False)
    assert [(b.batch_id, b.redelivered) for b in again] == [
        (second.batch_id, True),
        (third.batch_id, True),
    ]
    assert (len(last.groups), last.exhausted, stats.batches_held, stats.groups_held) == (
        0,
        True,
        0,
        0,
    )
    counters = stats.counters
    assert (counters["train:acked_batches"], counters["train:trained_groups"]) == (3, 6)
    assert (counters["train:held_batches"], counters["train:batches_reopened"]) == (3, 2)
    assert 'kuberl_buffer_acks_total{kind="train",result="held"} 3.0' in text
    assert 'kuberl_buffer_acks_total{kind="train",result="already_held"} 1.0' in text


def test_the_client_stubs_group_by_group_puts_are_stored_and_served_unchanged(
    redis_url: str, tmp_path: Path
) -> None:
    # kuberl.common.buffer_client: what rollout replicas send, as a message (split while
    # serialized) and as bytes encoded beforehand; the trainer must get each group as it was made.
    config = write_job(tmp_path, redis_url, prompts=4)
    with start_buffer(config, tmp_path) as proc, Client(proc.address) as client:
        stub = BufferStub(client.channel)
        prompts = list(client.lease(4).prompts)
        made = [group_for(p) for p in prompts]
        head = bpb.PutTrajectoriesRequest(
            consumer="r0", lease_ids=[p.lease_id for p in prompts[:2]]
        )
        as_message = stub.PutTrajectories(
            bpb.PutTrajectoriesRequest(
                groups=made[2:], consumer="r0", lease_ids=[p.lease_id for p in prompts[2:]]
            ),
            timeout=30,
        )
        as_bytes = stub.PutTrajectories(encode_put(head, made[:2]), timeout=30)
        batch = client.get(4)
    statuses = [r.status for r in (*as_bytes.results, *as_message.results)]
    assert statuses == [bpb.PUT_STATUS_ACCEPTED] * 4
    served = {g.prompt_id: g for g in batch.groups}
    for g in made:
        g.group_id = g.group_id or f"{g.prompt_id}@{g.epoch}"
    assert served == {g.prompt_id: g for g in made}


@pytest.mark.parametrize(
    ("fsync", "crash"),
    [("everysec", False), ("always", True), ("everysec", True)],
    ids=["graceful-restart", "sigkill-fsync-always", "sigkill-fsync-everysec"],
)
def test_a_redis_restart_mid_job_loses_nothing_acknowledged(
    tmp_path: Path, fsync: str, crash: bool
) -> None:
    with EmbeddedRedis(tmp_path / "redis", appendfsync=fsync, die_with_parent=True) as redis:
        config = write_job(tmp_path, redis.url, prompts=6, batch_ack_timeout_seconds=1)
        with start_buffer(config, tmp_path) as proc, Client(proc.address) as client:
            prompts = client.lease(4).prompts
            client.complete(prompts[:3])
            client.stub.SetPolicyVersion(bpb.SetPolicyVersionRequest(version=2), timeout=10)
            batch = client.get(2)
            if crash and fsync == "everysec":
                # docs/buffer.md: a process crash loses no acknowledged write, except while a
                # slow background fsync makes Redis hold writes back, for at most 2 s. Past
                # that, every write above must be in the AOF whatever the disk did.
                time.sleep(2.5)
            if crash:
                redis.kill()
            else:
                redis.stop()
            # A put that arrives while Redis is down is retried until Redis is back.
            result: dict[str, list[int]] = {}
            late = threading.Thread(target=lambda: result.update(s=client.complete(prompts[3:])))
            late.start()
            time.sleep(0.5)
            redis.start()
            late.join(30)
            after = client.stats()
            duplicate = _code(lambda: client.complete(prompts[:1]))
            time.sleep(1.2)  # past batch_ack_timeout_seconds
            again = client.get(2)
    assert (result, duplicate) == ({"s": [ACCEPTED]}, grpc.StatusCode.ALREADY_EXISTS)
    assert (after.policy_version, after.groups_pending, after.batches_unacked) == (2, 2, 1)
    assert (again.batch_id, again.redelivered, len(again.groups)) == (batch.batch_id, True, 2)


def test_two_replicas_serve_one_job_as_one_buffer(redis_url: str, tmp_path: Path) -> None:
    config = write_job(tmp_path, redis_url, prompts=24, requeue_stale=False)
    with start_buffer(config, tmp_path, "a") as a, start_buffer(config, tmp_path, "b") as b:
        overlaps, accepted = _run_rollout_clients([a.address, b.address], clients=6)
        with Client(a.address) as via_a, Client(b.address) as via_b:
            batch = via_a.get(30)
            acks = [
                via_b.ack(batch.batch_id).already_acked,
                via_a.ack(batch.batch_id).already_acked,
            ]
            # A retried put: its lease was completed by the first, the accepted record decides.
            duplicate = _code(lambda: via_b.put([group_for(batch.groups[0])], ["1-1"]))
            stats = (via_a.stats(), via_b.stats())
    assert (overlaps, len(accepted), set(accepted.values())) == ([], 24, {1})
    assert (len(batch.groups), acks, duplicate) == (
        24,
        [False, True],
        grpc.StatusCode.ALREADY_EXISTS,
    )
    assert stats[0].counters == stats[1].counters
