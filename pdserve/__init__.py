"""pdserve: disaggregated prefill/decode LLM serving. The user-facing API."""
from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from pdserve.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "InvalidRequestError"]
