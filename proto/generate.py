"""Regenerate the protobuf / gRPC modules beside the .proto files: `python proto/generate.py`.

protoc writes imports as `from hybridserve.v1 import ...` (the proto package path); they are rewritten to
`hybridserve.proto.hybridserve.v1` where the modules live in this package. A test checks that running
this changes nothing.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_DIR = PROTO_ROOT / "hybridserve" / "v1"
_IMPORT = re.compile(r"^from hybridserve\.v1 import", re.MULTILINE)


def generate(out_root: Path) -> list[Path]:
    """Write the generated modules under out_root/hybridserve/v1; returns their paths."""
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = sorted((out_root / "hybridserve" / "v1").glob("*_pb2*.py*"))
    for path in written:
        path.write_text(_IMPORT.sub("from hybridserve.proto.hybridserve.v1 import", path.read_text()))
    return written


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            target = PROTO_DIR / path.name
            target.write_bytes(path.read_bytes())
            print(f"wrote {target.relative_to(PROTO_ROOT.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
