"""pdserve: disaggregated prefill/decode LLM serving. The user-facing API.

`import pdserve` loads neither torch, Ray nor gRPC: each name below is imported on
first use (PEP 562), so an SDK user pays only for the client.

Its own modules:
    cli.py, __main__.py  the `pdserve` command (`python -m pdserve`): serve, router,
                         demo, bench, sim, profile, admin, make-tiny-model
    cli_flags.py         argparse flags derived from documented config dataclasses
    admin_cli.py         `pdserve admin`: membership through the router's admin API
    env.py               every environment variable pdserve reads
    lazy.py              names loaded on first use (this package, pdserve.kv_transfer)
    ray_session.py       how a command reaches Ray: a cluster of its own on this
                         machine, or one it joins with Ray's token when it wants one
    progress.py          the long commands' progress bars (off when stderr is not a
                         terminal, or with --quiet)
    demo.py              `pdserve demo`: 1 prefill + 1 decode worker on local Ray
    llm.py               LLM: offline batch inference
    client.py            the gRPC SDK: Client, AsyncClient, typed errors, retry on
                         overload
    v1/                  the gRPC stubs generated from proto/pdserve/v1/, and
                         sampling.py, SamplingParams <-> proto
    bench/               the goodput harness behind `pdserve bench`
    sim/                 the capacity simulator behind `pdserve sim` and
                         `pdserve profile`
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.lazy import lazy_names

# public name -> the module that defines it
_LAZY = {
    "LLM": "pdserve.llm",
    "SamplingParams": "pdserve.engine.sampling_params",
    "RequestOutput": "pdserve.engine.outputs",
    "InvalidRequestError": "pdserve.engine.errors",
    "Client": "pdserve.client",
    "AsyncClient": "pdserve.client",
    "Completion": "pdserve.client",
    "CompletionChunk": "pdserve.client",
    "PdserveError": "pdserve.client",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # for type checkers and IDEs; `as` marks a re-export
    from pdserve.client import AsyncClient as AsyncClient
    from pdserve.client import Client as Client
    from pdserve.client import Completion as Completion
    from pdserve.client import CompletionChunk as CompletionChunk
    from pdserve.client import PdserveError as PdserveError
    from pdserve.engine.errors import InvalidRequestError as InvalidRequestError
    from pdserve.engine.outputs import RequestOutput as RequestOutput
    from pdserve.engine.sampling_params import SamplingParams as SamplingParams
    from pdserve.llm import LLM as LLM

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
