"""`infermesh bench-plot` draws a bench's --json rows (raw_file.write_rows) as a PNG,
and says which columns exist when asked for one that does not."""

import json
from pathlib import Path

from tools.bench.raw_file import write_rows
from tools.cli import main


def rows_file(tmp_path: Path) -> Path:
    path = tmp_path / "rows.json"
    rows = [{"mode": mode, "batch": b, "tok_s": b * (2.0 if mode == "spec" else 1.0), "label": f"{mode}-{b}"}
            for mode in ("plain", "spec") for b in (1, 4, 16)]  # fmt: skip
    write_rows(path, rows, note="synthetic")
    return path


def test_rows_are_drawn_a_line_per_group(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    path = rows_file(tmp_path)
    assert main(["bench-plot", str(path), "--x", "batch", "--y", "tok_s", "--group", "mode", "--log-x"]) == 0
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "(6 points)" in capsys.readouterr().out
    # Names on the x axis are categories: one point each.
    out = tmp_path / "by_label.png"
    assert main(["bench-plot", str(path), "--x", "label", "--y", "tok_s", "--out", str(out)]) == 0
    assert out.stat().st_size > 0 and "(6 points)" in capsys.readouterr().out


def test_a_missing_column_or_file_without_rows_is_named(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    path = rows_file(tmp_path)
    assert main(["bench-plot", str(path), "--x", "batch", "--y", "ttft_ms"]) == 2
    said = capsys.readouterr().out
    assert "no column ttft_ms" in said and "batch, label, mode, tok_s" in said
    assert not path.with_suffix(".png").exists()
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"header": {}, "speedup": 1.2}))
    assert main(["bench-plot", str(bare), "--x", "a", "--y", "b"]) == 2
    assert "no rows" in capsys.readouterr().out
    assert main(["bench-plot", str(path), "--x", "batch", "--y", "label"]) == 2  # no numbers to draw


def test_an_older_bench_s_mapping_of_rows_is_drawn_by_name(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """bench-routing, bench-spec and others write {"rows": {name: figures}}: a row per name."""
    path = tmp_path / "routing.json"
    write_rows(path, [])
    data = json.loads(path.read_text())
    data["rows"] = {"disaggregated": {"completed": 4, "duration_s": 0.53},
                    "conditional": {"completed": 4, "duration_s": 0.75}}
    path.write_text(json.dumps(data))
    assert main(["bench-plot", str(path), "--x", "name", "--y", "duration_s"]) == 0
    assert "(2 points)" in capsys.readouterr().out
