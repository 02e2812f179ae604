"""API keys: `Authorization: Bearer <key>` on HTTP, the same metadata on gRPC.

A request's owner is who may abort it: the digest of the key it came with, or with
no keys configured, the caller's session (an unguessable id the SDK sends) or else
its connection. Nobody aborts by id alone."""
from __future__ import annotations

import hashlib
import hmac


class ApiKeys:
    def __init__(self, keys: tuple[str, ...] = ()):
        if any(not k for k in keys):
            raise ValueError("an API key must not be empty")
        self._keys = tuple(k.encode() for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> str | None:
        """The caller's key from an `Authorization` value, if it is one of ours (every
        key compared in constant time); None otherwise. With no keys: "" (open)."""
        if not self._keys:
            return ""
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        matched = [k for k in self._keys if hmac.compare_digest(k, given)]
        return matched[0].decode() if matched else None


def owner(key: str, session: str | None, connection: str) -> str:
    """Who owns a request: its key's digest; with keys off, its session or connection."""
    if key:
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return f"session:{session}" if session else f"conn:{connection}"
