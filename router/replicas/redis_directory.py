"""The request directory in Redis (`--redis-url`; docs/replicas.md): every router
replica claims the ids of its requests there, so a duplicate id is refused across
replicas and an abort reaching any replica is forwarded to the holder.

Keys, under the cluster's prefix P:
- `P:req:<request id>` = "<replica id>\\n<owner>\\n<claim nonce>": SET only if absent
  (or left by this replica: a release that could not reach Redis), with a TTL renewed
  every third of it while the request runs, deleted (if still this claim's: the nonce
  tells a re-claim of the same id from the claim a late release was for) when it ends. The TTL is
  what bounds the entries of a replica that died, and a renewal re-creates an entry
  lost with a restarted Redis: the directory is rebuilt from what the replicas hold.
- `P:abort:<replica id>`: the channel a replica hears forwarded aborts on,
  "<request id>\\n<owner>".

Redis unreachable: a claim counts as granted (each replica goes on with its own view;
no request fails for it), at once while the listener has not reconnected (a Redis
that does not answer must not cost every request the call timeout); a forwarded
abort finds nothing; the listener reconnects with jittered exponential backoff."""
from __future__ import annotations

import asyncio
import logging
import uuid

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdserve.router.replicas.redis_client import Reachability, listen, stopping
from pdserve.router.replicas.request_directory import AbortHere

log = logging.getLogger(__name__)

# Claim each key: set its entry (ARGV[i + 2]) if absent, or if this replica's own
# (ARGV[1] is "<replica>\n"; ARGV[2] the TTL); 1 where granted, 0 where refused.
_CLAIM = """
local granted = {}
for i, key in ipairs(KEYS) do
  local held = redis.call('GET', key)
  if held and string.sub(held, 1, string.len(ARGV[1])) ~= ARGV[1] then
    granted[i] = 0
  else
    redis.call('SET', key, ARGV[i + 2], 'EX', ARGV[2])
    granted[i] = 1
  end
end
return granted
"""
# Release: delete each entry that is still the value this replica set (ARGV[i]).
_RELEASE = """
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i] then n = n + redis.call('DEL', key) end
end
return n
"""
# Renew each held entry (ARGV[i] its value, ARGV[#KEYS + 1] the TTL): extend it, or
# set it again if it is gone (Redis restarted, or it expired while unreachable);
# one another replica took meanwhile stays theirs.
_RENEW = """
local ttl = ARGV[#KEYS + 1]
for i, key in ipairs(KEYS) do
  local held = redis.call('GET', key)
  if held == ARGV[i] then redis.call('EXPIRE', key, ttl)
  elseif not held then redis.call('SET', key, ARGV[i], 'EX', ttl) end
end
return #KEYS
"""


class RedisDirectory:
    def __init__(self, client: Redis, prefix: str, replica_id: str, ttl_s: float,
                 backoff_s: tuple[float, float] = (0.05, 5.0)):
        """client: decode_responses=True, with its own call timeouts (redis_client.py);
        backoff_s: the listener's first and longest wait between reconnections."""
        if "\n" in replica_id:
            raise ValueError("a replica id is one line")
        self.client, self.prefix, self.replica_id = client, prefix, replica_id
        self.ttl_s, self.backoff_s = ttl_s, backoff_s
        self.channel = f"{prefix}:abort:{replica_id}"
        self._claim = client.register_script(_CLAIM)
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)
        self._held: dict[str, str] = {}  # request id -> the entry's value
        # Claims go out in batches too: those made while one call is under way go
        # together in the next (one round trip, one script run, for all of them).
        self._to_claim: list[tuple[str, str, asyncio.Future]] = []
        self._claimer: asyncio.Task | None = None
        # Releases go out in batches, one call at a time: a release per request each on
        # its own connection starved the claims of connections at 64 in flight.
        self._to_release: dict[str, str] = {}
        self._releaser: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self._abort_here: AbortHere = lambda request_id, owner: False
        self.listening = asyncio.Event()  # set while subscribed to this replica's channel
        self.redis = Reachability("the requests in flight")
        self._unreachable, self._reached = self.redis.lost, self.redis.reached

    def key(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}"

    async def start(self, abort_here: AbortHere) -> None:
        self._abort_here = abort_here
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._listen()), loop.create_task(self._renewing())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for request_id in list(self._held):
            self.release(request_id)
        await self.flushed()
        await self.client.aclose()

    async def flushed(self) -> None:
        """Returns once every release so far has been sent (or given up on)."""
        while self._releaser is not None and not self._releaser.done():
            await asyncio.gather(self._releaser, return_exceptions=True)

    async def claim(self, request_id: str, owner: str) -> bool:
        value = f"{self.replica_id}\n{owner}\n{uuid.uuid4().hex[:12]}"
        if not self.redis.reachable:  # the listener says when Redis is back
            self._held[request_id] = value
            return True
        answer = asyncio.get_running_loop().create_future()
        self._to_claim.append((request_id, value, answer))
        if self._claimer is None or self._claimer.done():
            self._claimer = asyncio.get_running_loop().create_task(self._claim_all())
        granted = await answer
        if granted:
            self._held[request_id] = value
        return granted

    async def _claim_all(self) -> None:
        while self._to_claim:
            batch, self._to_claim = self._to_claim, []
            try:
                granted = await self._claim(
                    keys=[self.key(request_id) for request_id, _, _ in batch],
                    args=[f"{self.replica_id}\n", _seconds(self.ttl_s),
                          *(value for _, value, _ in batch)])
            except RedisError as err:
                self._unreachable("claim", err)
                granted = [1] * len(batch)  # this replica's own view: it checked its flights
            except Exception:  # a bug here must not leave a claim unanswered
                log.exception("request directory: a claim failed")
                granted = [1] * len(batch)
            else:
                self._reached()
            for (request_id, value, answer), ok in zip(batch, granted):
                if not answer.done():
                    answer.set_result(bool(ok))
                elif ok:  # its request was cancelled meanwhile: the entry goes
                    self._schedule_delete(request_id, value)

    def release(self, request_id: str) -> None:
        value = self._held.pop(request_id, None)
        if value is not None:
            self._schedule_delete(request_id, value)

    def _schedule_delete(self, request_id: str, value: str) -> None:
        self._to_release[request_id] = value
        if self._releaser is None or self._releaser.done():
            self._releaser = asyncio.get_running_loop().create_task(self._release_all())

    async def _release_all(self) -> None:
        while self._to_release:
            batch, self._to_release = self._to_release, {}
            await self._delete_many(batch)

    async def forward_abort(self, request_id: str, owner: str) -> bool:
        try:
            held = await self.client.get(self.key(request_id))
            if held is None:
                return False
            replica, holder = (held.split("\n") + [""])[:2]
            if replica == self.replica_id or holder != owner:
                return False  # not in flight here after all, or another caller's
            heard = await self.client.publish(f"{self.prefix}:abort:{replica}",
                                              f"{request_id}\n{owner}")
        except RedisError as err:
            self._unreachable("forward an abort", err)
            return False
        self._reached()
        return heard > 0

    async def _delete_many(self, entries: dict[str, str]) -> None:
        try:
            await self._release(keys=[self.key(r) for r in entries], args=list(entries.values()))
        except RedisError as err:  # their TTL ends them; a claim of an id here takes it
            self._unreachable("release", err)

    async def _renewing(self) -> None:
        """Every third of the TTL (sooner while Redis is unreachable, when it asks
        whether Redis answers again): each held entry extended, or set again if Redis
        lost it."""
        while not stopping():
            held = dict(self._held)
            wait_s = self.ttl_s / 3
            if not self.redis.reachable:  # claims skip Redis until it answers again
                try:
                    await self.client.ping()
                except RedisError:
                    wait_s = min(wait_s, self.backoff_s[1])
                else:
                    self._reached()
            if held and self.redis.reachable:
                try:
                    await self._renew(keys=[self.key(r) for r in held],
                                      args=[*held.values(), _seconds(self.ttl_s)])
                except RedisError as err:
                    self._unreachable("renew", err)
                    wait_s = min(wait_s, self.backoff_s[1])
                except Exception:  # a bug here must not end the renewals
                    log.exception("request directory: a renewal failed")
                else:
                    self._reached()
                    # one released while the renewal was under way may have been set
                    # again by it: released again
                    for request_id, value in held.items():
                        if self._held.get(request_id) != value:
                            self._schedule_delete(request_id, value)
            await asyncio.sleep(wait_s)

    async def _listen(self) -> None:
        """Hears the aborts other replicas forward here, resubscribing with jittered
        exponential backoff whenever the connection is lost."""
        def heard(data: str) -> None:
            request_id, _, owner = data.partition("\n")
            self._abort_here(request_id, owner)

        def up() -> None:
            self.listening.set()
            self._reached()

        def down(err: Exception) -> None:
            self.listening.clear()
            self._unreachable("listen", err)
        await listen(self.client, self.channel, heard, up, down, self.backoff_s,
                     "request directory")


def _seconds(ttl_s: float) -> int:
    return max(1, round(ttl_s))

