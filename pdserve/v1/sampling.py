"""SamplingParams <-> pdserve.v1.SamplingParams: the one mapping, by field name, that
the SDK (kwargs or a SamplingParams -> proto) and the gRPC server (proto ->
SamplingParams) share. Hand-written beside the generated stubs; a test holds the proto
message and the dataclass to the same field names."""
from __future__ import annotations

from dataclasses import fields

from pdserve.engine.sampling_params import SamplingParams
from pdserve.v1 import generate_pb2 as pb

FIELDS = tuple(f.name for f in fields(SamplingParams))


def to_proto(params: SamplingParams | None = None, **kwargs) -> pb.SamplingParams:
    """From a SamplingParams, or from its fields as keyword arguments (unset or None
    ones keep the server's defaults). Values are checked by the server, not here."""
    if params is not None:
        if kwargs:
            raise TypeError("pass sampling_params or sampling keyword arguments, not both")
        kwargs = {name: getattr(params, name) for name in FIELDS}
    unknown = set(kwargs) - set(FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling argument(s): {sorted(unknown)}")
    return pb.SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})


def from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults. A proto3 field without
    presence is always passed: its zero is the dataclass default (a test holds that)."""
    kwargs = {}
    for name in FIELDS:
        value = getattr(msg, name)
        if not isinstance(value, (str, bytes, int, float, bool)):  # repeated
            kwargs[name] = tuple(value)
        elif not msg.DESCRIPTOR.fields_by_name[name].has_presence or msg.HasField(name):
            kwargs[name] = value
    return SamplingParams(**kwargs)
