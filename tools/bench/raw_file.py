"""The header of every benchmark's raw file (docs/perf/): which commit ran, on what
device, by which exact command, when, with which versions. A figure whose raw file
does not say where it came from cannot be checked or rerun; every benchmark that
writes a file goes through here, so none can leave the header out.

    python -m tools.bench.raw_file --out docs/perf/swa.log -- python -m tools.bench.swa_bench
                                        # a benchmark that only prints: its output under the header
    python -m tools.bench.raw_file --command "bash tools/bench/h200.sh mesh"
                                        # the header alone, for a shell script's log

JSON raw files are `{"header": {...}, **figures}`; text and Markdown files begin with
the header's lines (`# key: value`, or a list in Markdown).
"""

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[2]
# Distribution names the NIXL wheel goes by (the CUDA major is in its name).
_NIXL_DISTRIBUTIONS = ("nixl", "nixl-cu12", "nixl-cu13")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout


def commit(root: Path = ROOT) -> str:
    """HEAD, with "+dirty" when tracked or untracked files outside docs/ differ from it
    (docs/ holds the raw files themselves: writing one must not mark its own run dirty).
    A copy of the tree without git (the device machine gets one) reads $INFERMESH_COMMIT."""
    try:
        head = _git(root, "rev-parse", "HEAD").strip()
        changed = [line[3:] for line in _git(root, "status", "--porcelain", "--untracked-files=all").splitlines()]
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("INFERMESH_COMMIT", "unknown (no git here; set INFERMESH_COMMIT)")
    dirty = any(not path.strip('"').startswith("docs/") for path in changed)
    return head + ("+dirty" if dirty else "")


def cpu() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {usable} cores usable of {os.cpu_count()}"


def device() -> str:
    """The GPU torch sees, else the CPU."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()} (x{torch.cuda.device_count()})"
    except ImportError:
        pass
    return cpu()


def _version(*names: str) -> str:
    for name in names:
        try:
            return f"{importlib.metadata.version(name)} ({name})" if len(names) > 1 else importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def versions() -> dict[str, str]:
    try:
        import torch

        torch_version = torch.__version__  # the build tag (+cpu, +cu130) is in it, not in the metadata
    except ImportError:
        torch_version = "not installed"
    return {
        "python": platform.python_version(),
        "torch": torch_version,
        "triton": _version("triton"),
        "nixl": _version(*_NIXL_DISTRIBUTIONS),
    }


def run_header(command: str | None = None) -> dict[str, Any]:
    """This process's header. The command is the interpreter's own argv (sys.orig_argv:
    `python -m tools.cli ...` as typed, not argparse's view of it) unless given;
    INFERMESH_* variables are recorded beside it because bench-mesh and the services
    read settings from them."""
    return {
        "commit": commit(),
        "device": device(),
        "cpu": cpu(),
        "command": command or shlex.join(getattr(sys, "orig_argv", sys.argv)),
        "cwd": os.getcwd(),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("INFERMESH_")},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
    }


def header_lines(header: Mapping[str, Any], markdown: bool = False) -> list[str]:
    lines = []
    for key, value in header.items():
        if isinstance(value, Mapping):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
        lines.append(f"- {key}: `{value}`" if markdown else f"# {key}: {value}")
    return lines


def write_json(path: str | Path, figures: Mapping[str, Any], header: Mapping[str, Any] | None = None) -> None:
    if "header" in figures:
        raise ValueError("the figures may not have a key 'header': it is the raw file's")
    _write(path, json.dumps({"header": dict(header or run_header()), **figures}, indent=2) + "\n")


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """`--json PATH`, the same flag and words on every bench that writes its rows."""
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="the result rows as JSON ({\"header\", \"rows\"}), under the raw-file header")  # fmt: skip


def write_rows(path: str | Path | None, rows: Iterable[Any], **figures: Any) -> None:
    """A bench's result rows as a JSON raw file: `{"header", "rows": [...], **figures}`.
    The rows are what the bench measured, one mapping (or dataclass) per printed row,
    numbers as numbers, not the printed text. path None: nothing is written."""
    if path is None:
        return
    as_dicts = [dataclasses.asdict(row) if dataclasses.is_dataclass(row) else dict(row) for row in rows]
    write_json(path, {"rows": as_dicts, **figures})


def write_text(path: str | Path, text: str, header: Mapping[str, Any] | None = None) -> None:
    """A text raw file (a Markdown one where path ends in .md) under the header."""
    lines = header_lines(header or run_header(), markdown=str(path).endswith(".md"))
    _write(path, "\n".join(lines) + "\n\n" + text.rstrip("\n") + "\n")


def read_json(path: str | Path) -> tuple[dict[str, Any] | None, Any]:
    """(header, figures) of a JSON raw file; a file from before the header: (None, its content)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and "header" in data:
        return data["header"], {k: v for k, v in data.items() if k != "header"}
    return None, data


def _write(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


class _Tee:
    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, encoding, ...: the terminal's
        return getattr(self.streams[0], name)


@contextmanager
def tee_stdout(path: str | Path | None, header: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Everything printed meanwhile also goes to path, under the header (taken as the
    run starts). A benchmark whose figures are its printed table writes its raw file so.
    path None: nothing is written."""
    if path is None:
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as log:
        log.write("\n".join(header_lines(header or run_header())) + "\n\n")
        held = sys.stdout
        sys.stdout = _Tee(held, log)  # type: ignore[assignment]
        try:
            yield
        finally:
            sys.stdout = held


def run_logged(command: list[str], out: str | Path) -> int:
    """Run a benchmark that only prints; its output (stdout and stderr) goes to the
    terminal and to out, under the header. Its exit status is returned. The header's
    versions are this interpreter's: run the command with the same one."""
    with tee_stdout(out, run_header(shlex.join(command))):
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert child.stdout is not None
        for line in child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
        return child.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.raw_file", description=__doc__.split("\n\n")[0],
                                usage="%(prog)s [--out PATH] [--command TEXT] [-- COMMAND ...]")  # fmt: skip
    p.add_argument("--out", help="the raw file of COMMAND's output")
    p.add_argument("--command", help="the command the header names (without a COMMAND to run)")
    p.add_argument("run", nargs=argparse.REMAINDER, help="-- and the benchmark's command line")
    args = p.parse_args(argv)
    command = args.run[1:] if args.run[:1] == ["--"] else args.run
    if command:
        if args.out is None or args.command is not None:
            p.error("a COMMAND needs --out (and names itself: no --command)")
        return run_logged(command, args.out)
    if args.out is not None:
        p.error("--out is for a COMMAND's output; the header alone is printed")
    print("\n".join(header_lines(run_header(args.command))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
