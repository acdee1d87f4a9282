"""Regenerate the Python code of proto/ into shared/proto/ (committed).

    .venv/bin/python proto/generate.py [OUT_DIR]

tests/test_proto.py regenerates into a temporary folder and fails when the
committed code is stale.
"""

import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE = "shared.proto"


def generate(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = sorted((PROTO_DIR / "infermesh").glob("*.proto"))
    for src in sources:
        # -I at the proto's own folder: generated modules are flat (kvcache_pb2.py).
        args = ["protoc", f"-I{src.parent}", f"--python_out={out_dir}", f"--pyi_out={out_dir}"]
        args += [f"--grpc_python_out={out_dir}", str(src)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {src}")
    written = sorted(p for p in out_dir.glob("*_pb2*.py*"))
    for path in written:
        # grpc_tools writes `import kvcache_pb2 as ...`, which only works with the
        # folder on sys.path; make it a package import.
        text = re.sub(r"^import (\w+_pb2) as", rf"from {PACKAGE} import \1 as", path.read_text(), flags=re.M)
        path.write_text(text)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "shared" / "proto"
    for p in generate(target):
        print(p.relative_to(target.parent) if p.is_relative_to(target.parent) else p)
