import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_generated_code_is_fresh(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), str(tmp_path)], check=True)
    fresh = sorted(p.name for p in tmp_path.glob("*_pb2*"))
    committed = sorted(p.name for p in (ROOT / "shared" / "proto").glob("*_pb2*"))
    assert fresh == committed, "run: .venv/bin/python proto/generate.py"
    stale = [n for n in fresh if not filecmp.cmp(tmp_path / n, ROOT / "shared" / "proto" / n, shallow=False)]
    assert not stale, f"stale generated code {stale}: run .venv/bin/python proto/generate.py"
