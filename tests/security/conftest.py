"""The five services under mutual TLS, started once for the whole security suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.security.cluster import Cluster, start_cluster, stop_cluster


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    started = start_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield started
    finally:
        stop_cluster(started)
