"""The environment variables pdserve reads, all in one place."""
from __future__ import annotations

import os


def api_key() -> str | None:
    """PDSERVE_API_KEY: the key `pdserve serve` requires and the SDK sends."""
    return os.environ.get("PDSERVE_API_KEY") or None


def admin_api_key() -> str | None:
    """PDSERVE_ADMIN_API_KEY: the key the admin API (/admin) requires; unset, no admin
    API is served. `pdserve admin` sends it."""
    return os.environ.get("PDSERVE_ADMIN_API_KEY") or None


def redis_url() -> str:
    """PDSERVE_REDIS_URL: the Redis router replicas share state in (`--redis-url`); the
    environment keeps its password off the command line."""
    return os.environ.get("PDSERVE_REDIS_URL", "")
