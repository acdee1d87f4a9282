"""`infermesh up`'s progress while the mesh starts: one bar for the weights the
workers load (read off the progress each worker writes to its log) and one for
the services that have come up (nats-server, kvcache, each worker, the
balancer), redrawn while Mesh waits for them (Mesh.on_wait)."""

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

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


class StartProgress:
    """Call update(mesh) as often as you like while it starts; close() at the end."""

    def __init__(self, num_workers: int, num_services: int) -> None:
        self.num_workers = num_workers
        self.weights = tqdm(total=0, desc="loading weights", unit="tensor", file=sys.stderr, leave=True,
                            bar_format="{desc}: {percentage:3.0f}%|{bar:30}| {n_fmt}/{total_fmt} {unit}s of "
                                       "{postfix}")  # fmt: skip
        self.weights.set_postfix_str(f"{num_workers} workers", refresh=False)
        self.services = tqdm(total=num_services, desc="services up    ", unit="service", file=sys.stderr, leave=True,
                             bar_format="{desc}: {percentage:3.0f}%|{bar:30}| {n_fmt}/{total_fmt} {postfix}")
        self._weights_done = False

    def update(self, mesh: "Mesh") -> None:
        workers = [n for n, _ in mesh.procs if n.startswith(("prefill-", "decode-"))]
        counts = [weights_loaded(mesh.state_dir / "logs" / f"{n}.log") for n in workers]
        if not self._weights_done and counts and all(c is not None for c in counts):
            total = sum(c[1] for c in counts)  # type: ignore[index]
            done = sum(c[0] for c in counts)  # type: ignore[index]
            if len(counts) == self.num_workers:
                self.weights.total = total
                self.weights.n = done
                self.weights.refresh()
                self._weights_done = done == total
        waiting = [n for n, _ in mesh.procs if n not in mesh.healthy]
        self.services.n = len(mesh.healthy)
        self.services.set_postfix_str(f"waiting for {', '.join(waiting)}" if waiting else "", refresh=False)
        self.services.refresh()

    def close(self) -> None:
        self.weights.close()
        self.services.close()
