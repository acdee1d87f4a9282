"""`infermesh bench-plot`: a bench's `--json` rows as a PNG, for the figures a person
would rather look at than read. Every bench that takes `--json` writes its measured
rows the same way (raw_file.write_rows), so one command draws any of them: one or
more columns against another, a line per value of a grouping column, and the raw
file's commit and device under the title, so the picture says where it came from.

    infermesh bench-spec ... --json spec.json
    infermesh bench-plot spec.json --x batch --y speedup --group mode
"""

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from tools.bench.raw_file import read_json  # noqa: E402


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return None if math.isnan(value) else float(value)


def as_rows(rows: Any) -> list[dict[str, Any]]:
    """A bench's rows as a list of mappings: write_rows' list, or the older benches'
    mapping of a name to its figures (each then a row with that name under "name")."""
    if isinstance(rows, dict) and rows and all(isinstance(v, dict) for v in rows.values()):
        return [{"name": name, **figures} for name, figures in rows.items()]
    if isinstance(rows, list) and all(isinstance(row, dict) for row in rows):
        return rows
    return []


def load_rows(path: str | Path, needed: Sequence[str]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(header, rows) of a bench's --json file; ValueError naming what is missing."""
    header, figures = read_json(path)
    rows = as_rows(figures.get("rows") if isinstance(figures, dict) else None)
    if not rows:
        raise ValueError(f"{path}: no rows (a bench's --json file has a list under \"rows\")")
    columns = set().union(*rows)
    missing = [c for c in needed if c not in columns]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(missing)}; its columns: {', '.join(sorted(columns))}")
    return header, rows


def plot(header: dict[str, Any] | None, rows: list[dict[str, Any]], x: str, ys: Sequence[str], group: str | None,
         out: Path, log_x: bool = False, log_y: bool = False, title: str = "") -> int:  # fmt: skip
    """Draw ys against x (a line per group value, a panel per y) into out; the points drawn."""
    xs = [row.get(x) for row in rows]
    categorical = any(_number(v) is None for v in xs)
    categories = list(dict.fromkeys(str(v) for v in xs)) if categorical else []
    groups = list(dict.fromkeys(str(row.get(group)) for row in rows)) if group else [""]
    fig, axes = plt.subplots(len(ys), 1, figsize=(8, 3.2 * len(ys)), squeeze=False)
    drawn = 0
    for ax, y in zip(axes[:, 0], ys):
        for name in groups:
            points = [
                (categories.index(str(row.get(x))) if categorical else _number(row.get(x)), _number(row.get(y)))
                for row in rows
                if not group or str(row.get(group)) == name
            ]
            points = sorted((px, py) for px, py in points if px is not None and py is not None)
            label = f"{group}={name}" if group else y
            if points and categorical:  # names along x: bars, the groups side by side
                width = 0.8 / len(groups)
                offset = (groups.index(name) - (len(groups) - 1) / 2) * width
                ax.bar([p[0] + offset for p in points], [p[1] for p in points], width=width, label=label)
            elif points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
            drawn += len(points)
        ax.set_xscale("log" if log_x and not categorical else "linear")
        ax.set_yscale("log" if log_y else "linear")
        if categorical:  # after the scale, which resets the ticks
            ax.set_xticks(range(len(categories)), categories, rotation=20, ha="right", fontsize=8)
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
        if ax.has_data() and group:
            ax.legend(fontsize=8)
    source = header or {}
    fig.suptitle(f"{title or out.stem}\ncommit {str(source.get('commit', '?'))[:12]}, {source.get('device', '?')}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return drawn


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="infermesh bench-plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("json", help="a bench's --json file")
    p.add_argument("--x", required=True, help="the column along the x axis (numbers, or names as categories)")
    p.add_argument("--y", required=True, nargs="+", help="the columns to draw, a panel each")
    p.add_argument("--group", default=None, help="a line per value of this column")
    p.add_argument("--out", default=None, help="the PNG (default: the JSON's path with .png)")
    p.add_argument("--log-x", action="store_true")
    p.add_argument("--log-y", action="store_true")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    try:
        header, rows = load_rows(args.json, [args.x, *args.y, *([args.group] if args.group else [])])
    except (ValueError, OSError) as exc:
        print(f"infermesh bench-plot: error: {exc}")
        return 2
    out = Path(args.out) if args.out else Path(args.json).with_suffix(".png")
    drawn = plot(header, rows, args.x, args.y, args.group, out, args.log_x, args.log_y, args.title)
    if drawn == 0:
        print(f"infermesh bench-plot: error: no row has numbers in {', '.join(args.y)} against {args.x}")
        return 2
    print(f"wrote {out} ({drawn} points)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
