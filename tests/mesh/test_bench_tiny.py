"""Every catalogued benchmark runs tiny on the CPU (issue 31, point 4): each one's
`tiny` arguments in tools/bench/catalog.py, run as `infermesh <command> ...` in a
child process, exit 0, print something, and write the files their flags name (a
JSON one parses and carries the raw-file header). A bench with no tiny run says why
in the catalog, so a new bench without either fails here. These are real processes
(meshes, nats-server, the kvcache service), hence tests/mesh."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import cli
from tools.bench.catalog import BENCHES, Bench, find
from tools.bench.plot_rows import as_rows
from tools.bench.plot_rows import main as plot_main
from tools.make_model import make_model

ROOT = Path(cli.__file__).resolve().parents[1]
# Flags whose value is a file or folder the bench writes.
_OUTPUT_FLAGS = ("--json", "--out", "--log")
TINY = [bench for bench in BENCHES if bench.tiny is not None]


def test_every_bench_runs_tiny_or_says_why() -> None:
    for bench in BENCHES:
        assert (bench.tiny is None) == bool(bench.not_tiny), f"{bench.command}: tiny arguments or a not_tiny reason"
        assert not (bench.gpu_only and bench.tiny is not None), f"{bench.command} is GPU only: it cannot run tiny here"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "llama"
    make_model(path, arch="llama", preset="tiny", seed=0)
    return path


def _run(bench: Bench, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # One OpenMP thread: the tiny models' ops are too small to share, and spinning
    # threads on a loaded host make them many times slower (tests/unit/test_v4_bench.py).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "tools.cli", bench.command, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def _arguments(bench: Bench, tmp: Path, model: Path) -> list[str]:
    tiny = bench.tiny or ()
    if any("{spec_json}" in arg for arg in tiny):  # bench-spec's tiny run writes it first, into the same folder
        spec = find("bench-spec")
        assert spec is not None and spec.tiny is not None and "{tmp}/spec.json" in spec.tiny
        ran = _run(spec, _arguments(spec, tmp, model), tmp)
        assert ran.returncode == 0, ran.stderr[-3000:]
    return [arg.format(tmp=tmp, model=model, spec_json=tmp / "spec.json") for arg in tiny]


def _plots(file: Path, rows: object) -> None:
    """`infermesh bench-plot` draws the rows: a number column against the first column."""
    rows = as_rows(rows)
    if not rows:
        return
    first = rows[0]
    x = next(iter(first))
    numbers = [k for k, v in first.items() if k != x and isinstance(v, int | float) and not isinstance(v, bool)]
    if numbers:
        out = file.with_suffix(".png")
        assert plot_main([str(file), "--x", x, "--y", numbers[0], "--out", str(out)]) == 0, file
        assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("bench", TINY, ids=lambda b: b.command)
def test_bench_runs_tiny(bench: Bench, model: Path, tmp_path: Path) -> None:
    args = _arguments(bench, tmp_path, model)
    ran = _run(bench, args, tmp_path)
    assert ran.returncode == 0, f"{bench.command} {' '.join(args)}\n{ran.stdout[-2000:]}\n{ran.stderr[-3000:]}"
    assert ran.stdout.strip(), f"{bench.command} printed nothing"
    for flag, value in zip(args, args[1:]):
        if flag not in _OUTPUT_FLAGS:
            continue
        path = Path(value)
        assert path.exists(), f"{bench.command} did not write {flag} {value}"
        files = sorted(path.iterdir()) if path.is_dir() else [path]
        assert files, f"{bench.command} wrote nothing into {value}"
        for file in files:
            if file.suffix == ".json":
                figures = json.loads(file.read_text())
                assert "commit" in figures["header"], file
                if flag == "--json":  # the bench's figures, not the header alone
                    assert any(figures[key] for key in figures if key != "header"), file
                    _plots(file, figures.get("rows"))
            elif file.suffix in (".txt", ".log"):
                assert file.read_text().startswith("# commit: "), file
