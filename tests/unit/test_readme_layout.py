"""README.md's layout table is the map of the house: every path it names exists, and
every package of shared/, services/ and tools/ that says what it holds (a module
docstring in its ``__init__.py``) has a row. A folder moved or added without its row
fails here, not in a newcomer's search.

A row names its paths in backticks in its first cell: ``| `shared/kv/` | what it holds |``.
Packages without a docstring (generated code) need no row."""

import ast
import re
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
"""The repository root, wherever in tests/ this file sits."""
README = ROOT / "README.md"
PACKAGE_ROOTS = ("shared", "services", "tools")
LAYOUT_HEADING = "## Layout"


def layout_rows(text: str) -> list[str]:
    """The table rows of the README's layout section (from its heading to the next one)."""
    start = text.index(LAYOUT_HEADING)
    end = text.find("\n## ", start + len(LAYOUT_HEADING))
    section = text[start : end if end != -1 else len(text)]
    return [line for line in section.splitlines() if line.startswith("|")]


def named_paths(rows: list[str]) -> list[str]:
    """Every backticked path in the rows' first cells, as written (folders end in '/')."""
    paths: list[str] = []
    for row in rows:
        first_cell = row.split("|")[1]
        paths.extend(re.findall(r"`([^`]+)`", first_cell))
    return paths


def documented_packages() -> list[str]:
    """Folders under PACKAGE_ROOTS (the roots included) whose __init__.py has a module
    docstring, as 'shared/kv/'."""
    found: list[str] = []
    for root in PACKAGE_ROOTS:
        for init in sorted((ROOT / root).rglob("__init__.py")):
            if ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))):
                found.append(init.parent.relative_to(ROOT).as_posix() + "/")
    return found


def test_layout_table_is_found() -> None:
    paths = named_paths(layout_rows(README.read_text(encoding="utf-8")))
    assert len(paths) >= len(PACKAGE_ROOTS), f"README.md's {LAYOUT_HEADING!r} table names too few paths: {paths}"


def test_every_named_path_exists() -> None:
    paths = named_paths(layout_rows(README.read_text(encoding="utf-8")))
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README.md's layout table names paths that do not exist (moved?): {missing}"


def test_every_documented_package_has_a_row() -> None:
    named = set(named_paths(layout_rows(README.read_text(encoding="utf-8"))))
    unnamed = [p for p in documented_packages() if p not in named]
    assert not unnamed, (
        f"packages with a docstring but no row in README.md's layout table: {unnamed}; "
        "add a row '| `path/` | what it holds |'"
    )
