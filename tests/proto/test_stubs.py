import filecmp
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_equal_a_fresh_generation(tmp_path):
    fresh = _generator().generate(tmp_path)
    assert {p.name for p in fresh} == {"generate_pb2.py", "generate_pb2.pyi",
                                       "generate_pb2_grpc.py"}
    for path in fresh:
        committed = ROOT / "pdserve" / "v1" / path.name
        assert filecmp.cmp(path, committed, shallow=False), (
            f"{committed} is stale: run `python scripts/gen_proto.py`")


def test_stubs_import_and_describe_the_service():
    from pdserve.v1 import generate_pb2, generate_pb2_grpc

    service = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"]
    assert [m.name for m in service.methods] == ["Generate", "Abort", "GetModelInfo"]
    assert service.methods_by_name["Generate"].server_streaming
    assert hasattr(generate_pb2_grpc, "GenerateServiceServicer")
