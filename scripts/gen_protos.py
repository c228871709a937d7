"""Regenerate jaxserve/entrypoints/grpc/pb/ (messages, stubs, type stubs) from protos/jaxserve.proto.

    python scripts/gen_protos.py [--out DIR]

Runs grpc_tools.protoc (pip install grpcio-tools), then makes the import in jaxserve_pb2_grpc.py
package-relative so the generated modules live inside the jaxserve package. It only writes the
generated files; tests/test_grpc.py checks that the checked-in copies are what this produces.
The generated code checks the protobuf and grpcio runtimes against the versions that made it, so
pyproject's lower bounds must follow the grpcio-tools used here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
PROTO_FILE = "jaxserve.proto"
DEFAULT_OUT = ROOT / "jaxserve" / "entrypoints" / "grpc" / "pb"
GENERATED = ("jaxserve_pb2.py", "jaxserve_pb2.pyi", "jaxserve_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules into out_dir; returns their paths."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"  # well-known types, as protoc's own -I
    rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{include}",
                      f"--python_out={out_dir}", f"--pyi_out={out_dir}",
                      f"--grpc_python_out={out_dir}", str(PROTO_DIR / PROTO_FILE)])
    if rc != 0:
        raise RuntimeError(f"grpc_tools.protoc failed with exit code {rc}")
    grpc_module = out_dir / "jaxserve_pb2_grpc.py"
    source = grpc_module.read_text()
    absolute = "import jaxserve_pb2 as jaxserve__pb2"
    if absolute not in source:
        raise RuntimeError(f"{grpc_module} no longer contains {absolute!r}; update this script")
    grpc_module.write_text(source.replace(absolute, "from . import jaxserve_pb2 as jaxserve__pb2"))
    return [out_dir / name for name in GENERATED]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
