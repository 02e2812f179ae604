from __future__ import annotations

import pytest

from tests.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    """Its own redis-server per test: fault tests kill it."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()
