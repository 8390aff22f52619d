"""The embedded Redis of local mode and tests: a real redis-server with AOF that survives
graceful restarts and SIGKILL on the same data folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from kuberl.common.redis_server import EmbeddedRedis, RedisServerError, find_redis_server


def test_start_returns_a_url_that_answers_and_keeps_its_port_across_restarts(
    tmp_path: Path,
) -> None:
    with EmbeddedRedis(tmp_path / "r", die_with_parent=True) as server:
        first = server.url
        client = redis.Redis.from_url(first)
        client.set("k", "v")
        client.close()
        second = server.restart()
        value = redis.Redis.from_url(second).get("k")
    assert (second, value) == (first, b"v")


def test_aof_is_on_with_everysec_fsync(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "r", die_with_parent=True) as server:
        config = redis.Redis.from_url(server.url).config_get("append*")
    assert (config["appendonly"], config["appendfsync"]) == ("yes", "everysec")


def test_a_write_fsynced_before_sigkill_is_replayed_from_the_aof(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "r", appendfsync="always", die_with_parent=True) as server:
        redis.Redis.from_url(server.url).xadd("s", {"f": "1"})
        server.restart(crash=True)
        length = redis.Redis.from_url(server.url).xlen("s")
    assert length == 1


def test_password_is_required_and_part_of_the_url(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "r", password="s3cret", die_with_parent=True) as server:
        assert redis.Redis.from_url(server.url).ping()
        anonymous = redis.Redis(host=server.host, port=server.port)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()


def test_a_taken_fixed_port_fails_with_the_server_log(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "a", die_with_parent=True) as first:
        clash = EmbeddedRedis(tmp_path / "b", port=first.port, die_with_parent=True)
        with pytest.raises(RedisServerError, match="Address already in use"):
            clash.start()


def test_start_returns_only_once_the_aof_is_replayed(tmp_path: Path) -> None:
    # Redis answers INFO while it replays the AOF and -LOADING to everything else; a real
    # redis-server with key-load-delay (a test setting of Redis: microseconds per command
    # replayed) makes the replay of 4,000 SETs take about a second.
    real = find_redis_server()
    slow = tmp_path / "slow-redis-server"
    slow.write_text(f'#!/bin/sh\nexec "{real}" "$@" --key-load-delay 250\n')
    slow.chmod(0o755)
    with EmbeddedRedis(tmp_path / "r", executable=str(slow), die_with_parent=True) as server:
        pipe = redis.Redis.from_url(server.url).pipeline(transaction=False)
        for i in range(4000):
            pipe.set(f"k{i}", i)
        pipe.execute()
        server.restart()
        size = redis.Redis.from_url(server.url).dbsize()
    assert size == 4000
