"""`infermesh up`'s start progress (tools/launch/progress.py) over a stand-in mesh
whose workers' logs carry the loader's tqdm lines: one line per change of state
when the output is not a terminal (however often it is looked at), bars with the
model's name on a terminal."""

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tools.launch.progress import StartProgress

PROCS = ["nats-server", "kvcache", "prefill-0", "decode-0", "balancer"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _mesh(tmp_path: Path) -> Any:
    (tmp_path / "logs").mkdir()
    return SimpleNamespace(procs=[(n, None) for n in PROCS], healthy=set(), state_dir=tmp_path)


def _loading(mesh: Any, worker: str, done: int, total: int) -> None:
    with (mesh.state_dir / "logs" / f"{worker}.log").open("a") as log:
        log.write(f"Loading weights:  {100 * done // total}%|####      | {done}/{total} [00:01<00:02]\r")


def test_not_a_terminal_one_line_per_change(tmp_path: Path) -> None:
    mesh, out = _mesh(tmp_path), io.StringIO()
    progress = StartProgress(2, len(PROCS), "tiny-model", out)
    mesh.healthy |= {"nats-server", "kvcache"}
    for _ in range(3):
        progress.update(mesh)
    _loading(mesh, "prefill-0", 10, 39)
    progress.update(mesh)  # one worker loading: not yet all of them
    _loading(mesh, "decode-0", 0, 39)
    for _ in range(3):
        progress.update(mesh)
    _loading(mesh, "prefill-0", 39, 39)
    _loading(mesh, "decode-0", 39, 39)
    mesh.healthy |= {"prefill-0", "decode-0"}
    progress.update(mesh)
    mesh.healthy.add("balancer")
    progress.update(mesh)
    progress.update(mesh)
    progress.close()
    assert out.getvalue().splitlines() == [
        "up: nats-server (1/5 services)",
        "up: kvcache (2/5 services)",
        "loading weights: 78 tensors of tiny-model, 2 workers",
        "weights loaded: 78/78 tensors of tiny-model",
        "up: prefill-0 (3/5 services)",
        "up: decode-0 (4/5 services)",
        "up: balancer (5/5 services)",
    ]
    assert "\r" not in out.getvalue()


def test_terminal_bars_name_the_model(tmp_path: Path) -> None:
    mesh, out = _mesh(tmp_path), Terminal()
    progress = StartProgress(2, len(PROCS), "tiny-{model}", out)
    _loading(mesh, "prefill-0", 39, 39)
    _loading(mesh, "decode-0", 39, 39)
    mesh.healthy |= {"nats-server"}
    progress.update(mesh)
    progress.close()
    text = out.getvalue()
    assert "78/78 tensors of tiny-{model}, 2 workers" in text
    assert "1/5, waiting for kvcache, prefill-0, decode-0, balancer" in text
    assert "\r" in text  # redrawn in place
