"""The goodput load-test harness behind `pdserve bench`: workloads, arrival
processes, per-request metrics and SLO goodput.

    cli.py        `pdserve bench run` and `pdserve bench compare`, and their flags
    workloads.py  seeded, locally generated workloads (lognormal lengths), as a list
                  or drawn one at a time
    sessions.py   agentic sessions: turns sent in order, each once the one before has
                  ended and a think time has passed, its prompt the history
    arrivals.py   when each request is sent: Poisson, gamma, or a trace's timestamps
    driver.py     drives pdserve's gRPC API or any OpenAI server, recording every
                  request's token arrival times
    metrics.py    per-request metrics, SLO goodput, figures by session turn and the
                  sweep's crossing point
    sweep.py      rate sweeps: the highest rate per worker holding the attainment target
    compare.py    disaggregated vs colocated, SLOs scaled from isolated latencies
    report.py     text, JSON, Markdown and PNG reports

require_extra (below) imports a module of the `bench` extra, or says how to get it.
"""
from __future__ import annotations

import importlib


def require_extra(module: str):
    """A module of the `bench` extra (httpx, matplotlib), or an error saying how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise SystemExit(f"pdserve bench needs {module}: pip install 'pdserve[bench]'") from err
