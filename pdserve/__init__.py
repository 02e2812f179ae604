"""pdserve: disaggregated prefill/decode LLM serving. The user-facing API.

`import pdserve` loads neither torch, Ray nor gRPC: each name below is imported on
first use (PEP 562), so an SDK user pays only for the client.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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

def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access skips this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
