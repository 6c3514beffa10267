"""Regenerates the committed Python stubs from proto/ (run by `make proto`).

The stubs live at service/rolloutd/v1/ so their own imports (`from rolloutd.v1 import ...`)
resolve inside the package. ``--check`` generates into a temporary directory and exits 1 if the
committed stubs differ.
"""

from __future__ import annotations

import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
OUT_ROOT = ROOT / "service"
STUB_DIR = Path("rolloutd") / "v1"
PROTOS = sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / STUB_DIR).glob("*.proto"))
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_source.binpb")
SOURCE_SET = "rollout_source.binpb"
"""The API's descriptors with their comments (source info), which the Python stubs leave out;
server reflection serves these, so ``grpcurl describe`` shows the documentation."""


def generate(out_root: Path) -> list[Path]:
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p) for p in PROTOS],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    described = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        "--include_source_info",
        f"--descriptor_set_out={out_root / STUB_DIR / SOURCE_SET}",
        *[str(p) for p in PROTOS],
    ]
    if protoc.main(described) != 0:
        raise SystemExit("protoc failed (descriptor set)")
    return sorted(p for p in (out_root / STUB_DIR).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main() -> int:
    if "--check" in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = generate(Path(tmp))
            stale = [
                p.name
                for p in fresh
                if not (OUT_ROOT / STUB_DIR / p.name).exists()
                or not filecmp.cmp(p, OUT_ROOT / STUB_DIR / p.name, shallow=False)
            ]
        if stale:
            print(f"stubs out of date: {', '.join(stale)}; run `make proto`")
            return 1
        return 0
    for path in generate(OUT_ROOT):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
