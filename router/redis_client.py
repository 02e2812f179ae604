"""The Redis client a router replica uses (`--redis-url`): every call bounded by
`--redis-timeout-s` (waiting for a free connection included) and never retried on the
request path (a router that cannot reach Redis goes on with its own view; the callers
decide what that means)."""
from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from pdserve.router.config import SharedStateSpec

HEALTH_CHECK_S = 5
# Connections per router: calls beyond them wait (up to the call timeout) for one to
# be free instead of failing, as a plain pool's do past its limit ("Too many
# connections", seen at 64 claims in flight).
MAX_CONNECTIONS = 32


def connect(spec: SharedStateSpec) -> Redis:
    """A client for spec.redis_url (redis://, rediss:// with TLS, unix://; a password in
    the URL); it connects on first use, and closes its pool with it."""
    pool = BlockingConnectionPool.from_url(
        spec.redis_url, max_connections=MAX_CONNECTIONS, timeout=spec.redis_timeout_s,
        decode_responses=True, socket_timeout=spec.redis_timeout_s,
        socket_connect_timeout=spec.redis_timeout_s, retry=Retry(NoBackoff(), 0),
        client_name="pdserve-router",
        # an idle connection is PINGed before use (a subscription's while it waits), so
        # one a network dropped silently is noticed
        health_check_interval=HEALTH_CHECK_S)
    return Redis.from_pool(pool)
