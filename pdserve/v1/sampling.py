"""SamplingParams <-> pdserve.v1.SamplingParams: the one mapping, by field name, that
the SDK (kwargs or a SamplingParams -> proto) and the gRPC server (proto ->
SamplingParams) share. Hand-written beside the generated stubs; a test holds the proto
message and the dataclass to the same field names."""
from __future__ import annotations

from dataclasses import fields

from pdserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from pdserve.v1 import generate_pb2 as pb

FIELDS = tuple(f.name for f in fields(SamplingParams))
STRUCTURED_FIELDS = tuple(f.name for f in fields(StructuredOutputsParams))


def to_proto(params: SamplingParams | None = None, **kwargs) -> pb.SamplingParams:
    """From a SamplingParams, or from its fields as keyword arguments (unset or None
    ones keep the server's defaults), or OpenAI's `response_format` (a dict, as the
    OpenAI API takes it) for structured_outputs. Values are checked by the server,
    not here."""
    if params is not None:
        if kwargs:
            raise TypeError("pass sampling_params or sampling keyword arguments, not both")
        kwargs = {name: getattr(params, name) for name in FIELDS}
    response_format = kwargs.pop("response_format", None)
    if response_format is not None:
        if kwargs.get("structured_outputs") is not None:
            raise TypeError("pass response_format or structured_outputs, not both")
        kwargs["structured_outputs"] = StructuredOutputsParams.from_response_format(
            response_format)
    unknown = set(kwargs) - set(FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling argument(s): {sorted(unknown)}")
    constraint = kwargs.pop("structured_outputs", None)
    msg = pb.SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})
    if constraint is not None:
        values = {name: getattr(constraint, name) for name in STRUCTURED_FIELDS}
        msg.structured_outputs.CopyFrom(pb.StructuredOutputs(
            **{k: v for k, v in values.items() if v is not None}))
    return msg


def from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults. A proto3 field without
    presence is always passed: its zero is the dataclass default (a test holds that)."""
    kwargs = {}
    for name in FIELDS:
        value = getattr(msg, name)
        if name == "structured_outputs":
            if msg.HasField(name):
                kwargs[name] = _structured(value)
        elif name == "logit_bias":  # a map
            kwargs[name] = dict(value) or None
        elif not isinstance(value, (str, bytes, int, float, bool)):  # repeated
            kwargs[name] = tuple(value)
        elif not msg.DESCRIPTOR.fields_by_name[name].has_presence or msg.HasField(name):
            kwargs[name] = value
    return SamplingParams(**kwargs)


def _structured(msg: pb.StructuredOutputs) -> StructuredOutputsParams:
    kwargs = {}
    for name in STRUCTURED_FIELDS:
        value = getattr(msg, name)
        if name == "choice":
            kwargs[name] = tuple(value) or None
        elif not msg.DESCRIPTOR.fields_by_name[name].has_presence or msg.HasField(name):
            kwargs[name] = value
    return StructuredOutputsParams(**kwargs)
