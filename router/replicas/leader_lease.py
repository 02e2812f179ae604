"""Which router replica's SLO planner acts: one per cluster. With `--redis-url` the
planners of every replica compete for a lease in Redis; the holder leads until it
stops renewing it, and another takes over within the lease's TTL. Each leadership
gets a fencing token larger than every earlier one, and the planner checks that its
token still holds before each action it carries out (a planner that lost the lease
while a tick was under way acts no more). Without Redis the one router leads.

Keys, under the cluster's prefix P:
- `P:planner:leader` = "<holder>\\n<token>", with a TTL in ms, renewed every third of
  it by its holder, deleted when the holder stops;
- `P:planner:epoch`: the last token handed out, kept a day. A new one is the larger
  of Redis's clock in microseconds and the last one + 1, so tokens grow across a Redis
  restarted without its data (or the epoch expired) too, as long as its clock does
  not go back.

Redis unreachable: the leader stops leading at once (no action on a lease it cannot
renew), so every planner pauses; when Redis returns, one leads again."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdserve.router.replicas.redis_client import stopping

if TYPE_CHECKING:
    from pdserve.router.config import SharedStateSpec

log = logging.getLogger(__name__)

# Acquire or renew (ARGV: holder, TTL in ms): the token held, or 0 if another holds it.
_LEAD = """
local held = redis.call('GET', KEYS[1])
if held then
  local holder, token = string.match(held, '^(.-)\\n(%d+)$')
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(token)
  end
  return 0
end
local now = redis.call('TIME')
local token = math.max(tonumber(now[1]) * 1000000 + tonumber(now[2]),
                       tonumber(redis.call('GET', KEYS[2]) or '0') + 1)
local text = string.format('%.0f', token)
redis.call('SET', KEYS[2], text, 'EX', 86400)
redis.call('SET', KEYS[1], ARGV[1] .. '\\n' .. text, 'PX', ARGV[2])
return token
"""
_LET_GO = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaderLease(Protocol):
    token: int  # this leadership's fencing token; 0 while not leading

    @property
    def leading(self) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def still_leading(self, token: int) -> bool:
        """Whether the lease is still this token's (checked before each action)."""


class SoleLeader:
    """One router: its planner leads."""
    token = 1
    leading = True

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def still_leading(self, token: int) -> bool:
        return True


class RedisLease:
    def __init__(self, client: Redis, prefix: str, holder: str, ttl_s: float):
        if "\n" in holder:
            raise ValueError("a holder's name is one line")
        self.client, self.holder, self.ttl_s = client, holder, ttl_s
        self.keys = [f"{prefix}:planner:leader", f"{prefix}:planner:epoch"]
        self._lead = client.register_script(_LEAD)
        self._let_go = client.register_script(_LET_GO)
        self.token = 0
        self._valid_until = 0.0  # monotonic: the lease outlives no renewal past this
        self.rounds = 0  # attempts to lead or renew so far
        self._renewing: asyncio.Task | None = None

    @property
    def leading(self) -> bool:
        return self.token > 0 and time.monotonic() < self._valid_until

    async def start(self) -> None:
        """Begins competing for the lease (again after start: nothing more)."""
        if self._renewing is None:
            self._renewing = asyncio.get_running_loop().create_task(self._renew())

    async def stop(self) -> None:
        """Lets go of the lease (again after stop: nothing more)."""
        if self._renewing is None or self._renewing.done():
            return
        self._renewing.cancel()
        await asyncio.gather(self._renewing, return_exceptions=True)
        if self.token:
            try:
                await self._let_go(keys=self.keys[:1], args=[f"{self.holder}\n{self.token}"])
            except RedisError:
                pass  # its TTL ends it
        self.token = 0
        await self.client.aclose()

    async def still_leading(self, token: int) -> bool:
        try:
            return await self.client.get(self.keys[0]) == f"{self.holder}\n{token}"
        except RedisError:
            return False

    async def _renew(self) -> None:
        while not stopping():
            asked = time.monotonic()
            try:
                token = int(await self._lead(keys=self.keys,
                                             args=[self.holder, max(1, round(self.ttl_s * 1e3))]))
            except RedisError as err:
                if self.token:
                    log.warning("planner: lost the lead (Redis unreachable: %s); it pauses",
                                err)
                token = 0
            except Exception:  # a bug here must not end the renewals: no lead meanwhile
                log.exception("planner: the lease's renewal failed")
                token = 0
            if token and token != self.token:
                log.warning("planner: %s leads (fencing token %d)", self.holder, token)
            self.token = token
            # The lease was (re)set after `asked`: it lasts at least until asked + ttl.
            self._valid_until = asked + self.ttl_s * 0.9 if token else 0.0
            self.rounds += 1
            await asyncio.sleep(self.ttl_s / 3)


def lease_for(spec: SharedStateSpec, holder: str) -> LeaderLease:
    """The lease `--redis-url` asks for: Redis's, or this router's alone."""
    if not spec.redis_url:
        return SoleLeader()
    from pdserve.router.replicas.redis_client import connect

    return RedisLease(connect(spec), spec.redis_prefix, holder, spec.leader_ttl_s)
