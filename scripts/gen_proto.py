"""Regenerate the Python stubs of proto/pdserve/v1/*.proto into pdserve/v1/.

    python scripts/gen_proto.py [OUT_DIR]

Run with the grpcio-tools version pinned in pyproject.toml; tests check that the
committed stubs equal a fresh generation.
"""
from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    files = sorted(PROTO_ROOT.glob("pdserve/v1/*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
            *[str(f.relative_to(PROTO_ROOT)) for f in files]]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_dir / "pdserve" / "v1").glob("*.py*"))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(out):
        print(path)
