"""Generates the Python code of proto/unicron/v1 into unicron/v1 (never edit the output)."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT_PACKAGE = ROOT / "unicron" / "v1"


def main() -> int:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "unicron" / "v1").glob("*.proto"))
    OUT_PACKAGE.mkdir(parents=True, exist_ok=True)
    for stale in OUT_PACKAGE.glob("*_pb2*.py*"):
        stale.unlink()
    # protoc does not add its bundled google/protobuf includes when called as a library.
    well_known = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        *protos,
    ]
    code = protoc.main(args)
    if code != 0:
        print(f"protoc failed with exit code {code}", file=sys.stderr)
        return code
    (OUT_PACKAGE / "__init__.py").write_text(
        '"""Generated from proto/unicron/v1 by scripts/gen_protos.py. Do not edit."""\n'
    )
    print(f"generated {len(protos)} protos into {OUT_PACKAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
