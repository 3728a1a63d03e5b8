"""HPS fixtures: a session-scoped 3-node Redis cluster (started once, stopped by pid) and
small sparse tables with non-contiguous keys."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.hps.redis_local import LocalRedisCluster, redis_available


@pytest.fixture(scope="session")
def _redis_cluster_session(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LocalRedisCluster | None]:
    if not redis_available():
        yield None
        return
    rc = LocalRedisCluster(
        3, tmp_path_factory.mktemp("redis_cluster"), node_timeout_ms=1000
    ).start()
    try:
        yield rc
    finally:
        rc.stop()


@pytest.fixture
def redis_cluster(require, _redis_cluster_session: LocalRedisCluster | None) -> LocalRedisCluster:
    """The shared 3-node cluster (skip locally / FAIL in CI when redis-server is missing).
    Every node is alive when a test starts."""
    require(_redis_cluster_session is not None, "redis-server")
    rc = _redis_cluster_session
    for i in range(rc.n):
        rc.restart(i)  # no-op for live nodes
    return rc
