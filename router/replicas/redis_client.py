"""The Redis client a router replica uses (`--redis-url`): every call bounded by
`--redis-timeout-s` (waiting for a free connection included), retried once, at once,
only when its connection was closed (a pooled connection to a Redis that restarted
fails its first use: without the retry each of them lost one call, an abort among
them) and never after a timeout (a router that cannot reach Redis goes on with its own
view; the callers decide what that means)."""
from __future__ import annotations

import asyncio
import logging
import random
from typing import Callable

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, RedisError

from pdserve.router.config import SharedStateSpec

log = logging.getLogger(__name__)

HEALTH_CHECK_S = 5
# Connections per router: calls beyond them wait (up to the call timeout) for one to
# be free instead of failing, as a plain pool's do past its limit ("Too many
# connections", seen at 64 claims in flight).
MAX_CONNECTIONS = 32


class Reachability:
    """Whether Redis answered this part of a router (the directory, the registry) last
    time: one warning when it is lost, one when it is back."""

    def __init__(self, own_view: str):
        self.own_view = own_view  # what the router goes on with meanwhile
        self.reachable = True

    def lost(self, what: str, err: Exception) -> None:
        if self.reachable:
            log.warning("Redis unreachable (%s: %s): this router goes on with its own "
                        "view of %s", what, err, self.own_view)
        self.reachable = False

    def reached(self) -> None:
        if not self.reachable:
            log.warning("Redis reachable again (%s)", self.own_view)
        self.reachable = True


def connect(spec: SharedStateSpec) -> Redis:
    """A client for spec.redis_url (redis://, rediss:// with TLS, unix://; a password in
    the URL); it connects on first use, and closes its pool with it."""
    pool = BlockingConnectionPool.from_url(
        spec.redis_url, max_connections=MAX_CONNECTIONS, timeout=spec.redis_timeout_s,
        decode_responses=True, socket_timeout=spec.redis_timeout_s,
        socket_connect_timeout=spec.redis_timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(ConnectionError,)),
        client_name="pdserve-router",
        # an idle connection is PINGed before use (a subscription's while it waits), so
        # one a network dropped silently is noticed
        health_check_interval=HEALTH_CHECK_S)
    return Redis.from_pool(pool)


def stopping() -> bool:
    """Whether the running task was asked to stop. redis-py can swallow a cancellation
    that races a command's timeout (redis/redis-py#2551, #2028): the task's request
    stays counted (Task.cancelling()) but no CancelledError arrives, and a loop that
    outlives a failed call would run on, its task never ending (seen: a registry's
    stop() waiting forever on its renewals). Every long-lived loop over Redis
    checks this."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def listen(client: Redis, channel: str, on_message: Callable[[str], None],
                 on_up: Callable[[], None], on_down: Callable[[Exception], None],
                 backoff_s: tuple[float, float], what: str) -> None:
    """Hears `channel` for as long as it runs: on_message(data) for each message,
    on_up() once subscribed (again: what was said meanwhile is lost, so a caller
    reads what it missed), on_down(error) when the connection is lost, after which it
    resubscribes with jittered exponential backoff (backoff_s: the first and longest
    wait)."""
    delay = backoff_s[0]
    while not stopping():
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        subscribed = False
        try:
            await pubsub.subscribe(channel)
            while not stopping():
                # the first read takes the subscription's confirmation; the client's
                # health checks PING an idle connection, so a dead one is noticed
                message = await pubsub.get_message(timeout=1.0)
                if not subscribed:
                    subscribed = True
                    delay = backoff_s[0]
                    on_up()
                if message is not None:
                    on_message(message["data"])
        except (RedisError, OSError) as err:
            on_down(err)
        except Exception:  # a bug here must not end the listening for good
            log.exception("%s: the listener failed", what)
        finally:
            await quietly(pubsub.aclose())
        await asyncio.sleep(random.uniform(0, delay))
        delay = min(delay * 2, backoff_s[1])


async def quietly(closing) -> None:
    """Awaits a close that may fail on a connection already lost."""
    try:
        await closing
    except (RedisError, OSError):
        pass



def blocking(spec: SharedStateSpec):
    """A client for calls made outside any event loop (before a router starts), each
    within the call timeout; close it after use."""
    from redis import Redis as BlockingRedis

    return BlockingRedis.from_url(spec.redis_url, decode_responses=True,
                                  socket_timeout=spec.redis_timeout_s,
                                  socket_connect_timeout=spec.redis_timeout_s)
