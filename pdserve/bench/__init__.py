"""The goodput load-test harness behind `pdserve bench`: workloads, arrival
processes, per-request metrics and SLO goodput."""
from __future__ import annotations

import importlib


def require_extra(module: str):
    """A module of the `bench` extra (httpx, matplotlib), or an error saying how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise SystemExit(f"pdserve bench needs {module}: pip install 'pdserve[bench]'") from err
