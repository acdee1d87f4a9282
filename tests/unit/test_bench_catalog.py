"""Every benchmark under tools/bench is reachable from `infermesh` (issue 31, point 4):
tools/bench/catalog.py names each module a benchmark or a helper, so a new bench cannot
be left out unnoticed; `infermesh --help` lists every one; each takes `--help`."""

import ast
from pathlib import Path

import pytest

from tools import cli
from tools.bench.catalog import BENCHES, HELPERS, find

BENCH_DIR = Path(cli.__file__).parent / "bench"


def _tree(module: str) -> ast.Module:
    return ast.parse((BENCH_DIR / f"{module}.py").read_text())


def _runnable(tree: ast.Module) -> bool:
    """A module a person runs: a top-level main, or an `if __name__ == "__main__"` block."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            return True
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return True
    return False


def test_every_module_is_a_bench_or_a_helper() -> None:
    modules = {path.stem for path in BENCH_DIR.glob("*.py")}
    catalogued = [bench.module for bench in BENCHES]
    assert len(catalogued) == len(set(catalogued)), "a module catalogued twice"
    assert not set(catalogued) & set(HELPERS), "a module both a bench and a helper"
    unlisted = modules - set(catalogued) - set(HELPERS)
    assert not unlisted, f"add these to tools/bench/catalog.py (BENCHES or HELPERS): {sorted(unlisted)}"
    assert not (set(catalogued) | set(HELPERS)) - modules, "the catalog names a module that is gone"


def test_runnable_helpers_are_only_the_known_ones() -> None:
    """A helper with its own main is a bench in disguise, but for these three: raw_file wraps a
    bench, local_server's __main__ is bench-mesh's child process, plot_rows draws any bench's
    rows (`infermesh bench-plot`)."""
    runnable = {module for module in HELPERS if module != "__init__" and _runnable(_tree(module))}
    assert runnable == {"raw_file", "local_server", "plot_rows"}


def test_each_dispatched_bench_has_main_taking_argv() -> None:
    for bench in BENCHES:
        if bench.parsed_in_cli:
            continue
        mains = [n for n in _tree(bench.module).body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        assert len(mains) == 1, f"{bench.module} has no top-level main"
        params = [a.arg for a in mains[0].args.args]
        assert params == ["argv"], f"{bench.module}.main takes {params}, not (argv)"
        assert bench.command.startswith("bench-") and find(bench.command) is bench


def test_gpu_only_benches_say_so() -> None:
    for bench in BENCHES:
        assert bench.help.endswith("(GPU only)") == bench.gpu_only
    assert {b.command for b in BENCHES if b.gpu_only} == {"bench-gpu", "bench-cuda-vmm"}


def test_help_lists_every_bench(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
    for bench in BENCHES:
        assert f"{bench.command} " in text, bench.command
        assert " ".join(bench.help.split()[:4]) in text, bench.command


@pytest.mark.parametrize("bench", BENCHES, ids=lambda b: b.command)
def test_each_bench_takes_help(bench, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main([bench.command, "--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_arguments_reach_the_module(capsys: pytest.CaptureFixture[str]) -> None:
    """A flag the module's own parser refuses comes back as its error (exit 2), not infermesh's."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench-v4-kv-pages", "--no-such-flag"])
    assert exit_.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err


def test_docs_list_every_bench() -> None:
    text = (BENCH_DIR.parent.parent / "docs" / "benchmarks.md").read_text()
    for bench in BENCHES:
        assert f"| `infermesh {bench.command}` |" in text, f"docs/benchmarks.md's table lacks {bench.command}"
        row = f"| `infermesh {bench.command}` | {bench.help} | {bench.output} | `{bench.module}` |"
        assert row in text, f"docs/benchmarks.md's row of {bench.command} differs from the catalog's"
