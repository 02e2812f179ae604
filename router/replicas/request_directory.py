"""Which router holds each request in flight, as every replica needs to know it: a
request id is claimed before the request is placed and released when it ends, so a
duplicate id is refused by whichever replica it reaches, and an abort that reaches a
replica not holding the request is forwarded to the one that does.

`LocalDirectory` is the embedded default (one router: its own flights are the whole
directory, so it claims everything and forwards nothing); `RedisDirectory`
(redis_directory.py) shares it among replicas with `--redis-url`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from pdserve.router.config import SharedStateSpec

# Called with (request_id, owner) when another replica forwards an abort here; True
# when this router held the request and ended it.
AbortHere = Callable[[str, str], bool]


class RequestDirectory(Protocol):
    async def start(self, abort_here: AbortHere) -> None:
        """Begins taking aborts forwarded to this router."""

    async def stop(self) -> None:
        """Releases what this router holds and stops taking aborts."""

    async def claim(self, request_id: str, owner: str) -> bool:
        """Records the request as this router's; False when another router holds the
        id. A directory that cannot answer in time claims (the router goes on with its
        own view: no request fails for it)."""

    def release(self, request_id: str) -> None:
        """The request ended here: its entry goes (without waiting for the store)."""

    async def forward_abort(self, request_id: str, owner: str) -> bool:
        """An abort for a request this router does not hold: True when the directory
        names another router holding it for this owner, which is told to end it."""


class LocalDirectory:
    """One router alone: nothing to share."""

    async def start(self, abort_here: AbortHere) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def claim(self, request_id: str, owner: str) -> bool:
        return True

    def release(self, request_id: str) -> None:
        pass

    async def forward_abort(self, request_id: str, owner: str) -> bool:
        return False


def directory_for(spec: SharedStateSpec, replica_id: str) -> RequestDirectory:
    """The directory `--redis-url` asks for: Redis's, or this router's alone."""
    if not spec.redis_url:
        return LocalDirectory()
    from pdserve.router.replicas.redis_client import connect
    from pdserve.router.replicas.redis_directory import RedisDirectory

    return RedisDirectory(connect(spec), spec.redis_prefix, replica_id, spec.request_ttl_s)
