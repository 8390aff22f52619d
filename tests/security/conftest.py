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


#: The suite shares one set of services, and fuzzing leaves state behind that is legitimate but
#: in the way (every prompt leased, a huge weight version announced): the checks that need a
#: clean job run first, whatever order the files are named in.
ORDER = ("test_code_scan", "test_job_files", "test_fuzz_semantics", "test_tls", "test_redis")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        return ORDER.index(module) if module in ORDER else len(ORDER)

    items.sort(key=rank)  # stable: keeps each file's own order
