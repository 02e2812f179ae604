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


def ray_auth_mode() -> str | None:
    """RAY_AUTH_MODE: Ray's authentication mode (token or disabled); unset, Ray's default."""
    return os.environ.get("RAY_AUTH_MODE") or None


def ray_auth_token_source() -> str | None:
    """Where Ray would find its authentication token, in Ray's order: RAY_AUTH_TOKEN,
    the file RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token; None where there is none."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return f"RAY_AUTH_TOKEN_PATH ({path})"
    default = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return default if os.path.isfile(default) else None
