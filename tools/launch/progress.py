"""`infermesh up`'s progress while the mesh starts: the weights the workers load
(read off the progress each worker writes to its log) and the services that have
come up (nats-server, kvcache, each worker, the balancer), looked at while Mesh
waits for them (Mesh.on_wait).

On a terminal these are two bars, redrawn in place. Elsewhere (a log file, a pipe,
systemd's journal) a redraw is a line per tick, so there the progress is one line
per change of state instead: weights started, weights loaded, each service up.
"""

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from tqdm import tqdm

if TYPE_CHECKING:
    from tools.launch.up import Mesh

# The loader's tqdm line, as the worker writes it to its log: "Loading weights:  40%|...| 8/20 [...]".
_LOADING = re.compile(rb"Loading weights:\s*\d+%\|[^|]*\|\s*(\d+)/(\d+)")
_TAIL_BYTES = 16 << 10


def weights_loaded(log: Path) -> tuple[int, int] | None:
    """(tensors loaded, tensors) by the last progress line in a worker's log; None before loading starts."""
    try:
        with log.open("rb") as f:
            f.seek(max(f.seek(0, 2) - _TAIL_BYTES, 0))
            tail = f.read()
    except OSError:
        return None
    found = _LOADING.findall(tail)
    if not found:
        return None
    done, total = found[-1]
    return int(done), int(total)


@dataclass(frozen=True, slots=True)
class StartState:
    """What a look at the starting mesh saw."""

    weights: tuple[int, int] | None
    """(tensors loaded, tensors) over every worker, once each has started loading."""
    healthy: tuple[str, ...]
    """The processes up, in start order."""
    waiting: tuple[str, ...]


def look(mesh: "Mesh", num_workers: int) -> StartState:
    workers = [n for n, _ in mesh.procs if n.startswith(("prefill-", "decode-"))]
    counts = [weights_loaded(mesh.state_dir / "logs" / f"{n}.log") for n in workers]
    weights = None
    if len(counts) == num_workers and counts and all(c is not None for c in counts):
        weights = (sum(c[0] for c in counts if c), sum(c[1] for c in counts if c))
    healthy = tuple(n for n, _ in mesh.procs if n in mesh.healthy)
    waiting = tuple(n for n, _ in mesh.procs if n not in mesh.healthy)
    return StartState(weights, healthy, waiting)


class StartProgress:
    """Call update(mesh) as often as you like while it starts; close() at the end.
    Bars where stream is a terminal, else one line per change (LineProgress)."""

    def __init__(self, num_workers: int, num_services: int, model_name: str, stream: TextIO | None = None) -> None:
        stream = stream or sys.stderr
        self.lines = None if stream.isatty() else LineProgress(num_workers, num_services, model_name, stream)
        self.num_workers = num_workers
        if self.lines is not None:
            return
        of = f"{model_name}, {num_workers} workers".replace("{", "{{").replace("}", "}}")  # a format string
        self.weights = tqdm(total=0, desc="loading weights", unit="tensor", file=stream, leave=True,
                            bar_format="{desc}: {percentage:3.0f}%|{bar:30}| {n_fmt}/{total_fmt} {unit}s of " + of)
        self.services = tqdm(total=num_services, desc="services up    ", unit="service", file=stream, leave=True,
                             bar_format="{desc}: {percentage:3.0f}%|{bar:30}| {n_fmt}/{total_fmt}{postfix}")
        self._weights_done = False

    def update(self, mesh: "Mesh") -> None:
        state = look(mesh, self.num_workers)
        if self.lines is not None:
            self.lines.update(state)
            return
        if not self._weights_done and state.weights is not None:
            self.weights.n, self.weights.total = state.weights
            self.weights.refresh()
            self._weights_done = state.weights[0] == state.weights[1]
        self.services.n = len(state.healthy)
        self.services.set_postfix_str(f"waiting for {', '.join(state.waiting)}" if state.waiting else "",
                                      refresh=False)  # fmt: skip
        self.services.refresh()

    def close(self) -> None:
        if self.lines is None:
            self.weights.close()
            self.services.close()


class LineProgress:
    """The same progress as lines, one per change of state, for output that is not a terminal."""

    def __init__(self, num_workers: int, num_services: int, model_name: str, stream: TextIO) -> None:
        self.num_workers, self.num_services, self.model_name, self.stream = num_workers, num_services, model_name, stream
        self._weights = "waiting"
        """waiting, loading or loaded."""
        self._healthy: set[str] = set()

    def update(self, state: StartState) -> None:
        if state.weights is not None and self._weights != "loaded":
            done, total = state.weights
            if self._weights == "waiting":
                self._say(f"loading weights: {total} tensors of {self.model_name}, {self.num_workers} workers")
                self._weights = "loading"
            if done == total:
                self._say(f"weights loaded: {total}/{total} tensors of {self.model_name}")
                self._weights = "loaded"
        for name in state.healthy:
            if name not in self._healthy:
                self._healthy.add(name)
                self._say(f"up: {name} ({len(self._healthy)}/{self.num_services} services)")

    def _say(self, line: str) -> None:
        print(line, file=self.stream, flush=True)
