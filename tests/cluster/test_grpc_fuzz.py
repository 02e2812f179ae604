"""A property-based fuzz of the gRPC request: any GenerateRequest the proto can carry
(every field, any value its type allows: NaN and infinities, extreme integers, odd
text) gets OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED, never another status, and the
server keeps serving. Messages are generated from the proto's own descriptor, so a
new field is fuzzed without an edit here."""
from __future__ import annotations

import grpc
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.client import Client
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
SCALARS = {
    F.TYPE_INT32: st.integers(-2**31, 2**31 - 1), F.TYPE_UINT32: st.integers(0, 2**32 - 1),
    F.TYPE_INT64: st.integers(-2**63, 2**63 - 1), F.TYPE_BOOL: st.booleans(),
    F.TYPE_FLOAT: st.floats(width=32), F.TYPE_DOUBLE: st.floats(),
    F.TYPE_STRING: st.text(max_size=64),
}
# Small values as often as extreme ones, so requests also get past validation.
SMALL = {F.TYPE_INT32: st.integers(-3, 40), F.TYPE_UINT32: st.integers(0, 40),
         F.TYPE_INT64: st.integers(-3, 40), F.TYPE_FLOAT: st.floats(-3, 3, width=32),
         F.TYPE_DOUBLE: st.floats(-3, 3)}
# SLOs a request can meet as often as any other value, so requests with them get served.
MEETABLE = {"slo_ttft_ms": st.floats(1e4, 1e7), "slo_tpot_ms": st.floats(1e4, 1e7)}


def value_of(field):
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:  # a map: any keys and values
        key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
        return st.dictionaries(value_of(key), value_of(value), max_size=8)
    if field.type == F.TYPE_MESSAGE:
        single = message_of(field.message_type)
    else:
        single = SCALARS[field.type]
        if field.type in SMALL:
            single = st.one_of(SMALL[field.type], single)
        if field.name in MEETABLE:
            single = st.one_of(MEETABLE[field.name], single)
    return st.lists(single, max_size=8) if field.is_repeated else single


def message_of(descriptor) -> st.SearchStrategy:
    """Any message of this type: each field set or left unset; one member of a oneof."""
    fields = {f.name: st.none() | value_of(f) for f in descriptor.fields
              if f.containing_oneof is None}
    oneofs = {o.name: st.sampled_from(list(o.fields)).flatmap(
        lambda f: st.tuples(st.just(f.name), value_of(f))) for o in descriptor.oneofs}

    def build(values: dict, chosen: dict):
        msg = pb.__dict__[descriptor.name]()
        for name, value in [*values.items(), *chosen.values()]:
            if value is None:
                continue
            target = getattr(msg, name)
            if isinstance(value, dict):  # a map
                target.update(value)
            elif isinstance(value, list) and hasattr(target, "add"):  # repeated messages
                for item in value:
                    target.add().CopyFrom(item)
            elif isinstance(value, list):
                target.extend(value)
            elif hasattr(value, "DESCRIPTOR"):
                target.CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg
    return st.builds(build, st.fixed_dictionaries(fields), st.fixed_dictionaries(oneofs))


@given(request=message_of(pb.GenerateRequest.DESCRIPTOR))
@settings(max_examples=150, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def fuzz(stub, seen, request):
    call = stub.Generate(request, timeout=60)
    try:
        for _ in call:
            pass
        code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        code = err.code()
    assert code in ALLOWED, (code, call.details(), request)
    seen.add(code)


def test_any_generate_request_gets_ok_invalid_argument_or_resource_exhausted(server):
    seen = set()
    with grpc.insecure_channel(server.grpc_target) as channel:
        fuzz(pb_grpc.GenerateServiceStub(channel), seen)
    # Not vacuous: requests were served, and refused.
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= seen
    with Client(server.grpc_target) as client:  # and the server still serves
        assert len(client.generate([5, 6, 7], max_tokens=4, ignore_eos=True).token_ids) == 4
