"""`infermesh up` explains itself: each way it cannot start is one line on
stderr, without a traceback, and what can be checked first is checked before
anything starts; a service that dies while the mesh starts is named with its
log's last lines; a good start shows its progress."""

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tools.make_model import make_model
from tests.helpers.hf_models import save_tiny_hf_model
from tools.launch.up import free_port


def up(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", "up", *args], capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip


def one_line_error(out: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    assert out.returncode == code, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("infermesh: error: "), out.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("up-model") / "m"
    make_model(path)
    return path


def copy_without(model: Path, dest: Path, *names: str) -> Path:
    shutil.copytree(model, dest)
    for pattern in names:
        for f in dest.glob(pattern):
            f.unlink()
    return dest


def test_a_missing_or_incomplete_model_is_named_before_anything_starts(model, tmp_path):
    state = tmp_path / "state"
    common = ["--port", str(free_port()), "--state-dir", str(state)]
    one_line_error(up("--model", str(tmp_path / "nowhere"), *common), 2, "does not exist", "nowhere")
    one_line_error(up("--model", str(model / "config.json"), *common), 2, "is a file")
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(up("--model", str(empty), *common), 2, f"no config.json in {empty}")
    no_weights = copy_without(model, tmp_path / "no-weights", "*.safetensors")
    one_line_error(up("--model", str(no_weights), *common), 2, "no weights", "safetensors")
    save_tiny_hf_model("llama", tmp_path / "no-tokenizer")  # transformers' own save: no tokenizer
    one_line_error(up("--model", str(tmp_path / "no-tokenizer"), *common), 2, "no tokenizer.json")
    alien = copy_without(model, tmp_path / "alien")
    config = json.loads((alien / "config.json").read_text())
    (alien / "config.json").write_text(json.dumps({**config, "architectures": ["MambaForCausalLM"]}))
    one_line_error(up("--model", str(alien), *common), 2, "cannot be served", "MambaForCausalLM")
    assert not state.exists()  # nothing was started, not even nats-server


def test_a_port_in_use_is_refused_before_anything_starts(model, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = up("--model", str(model), "--port", str(port), "--state-dir", str(tmp_path / "state"))
    one_line_error(out, 2, f"port {port} on 127.0.0.1 is in use", "--port")
    assert "InferMesh is up" not in out.stdout
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("flags", [("--prefill", "0"), ("--decode", "0")])
def test_zero_instances_are_refused_at_once(model, tmp_path, flags):
    out = up("--model", str(model), *flags, "--port", str(free_port()), "--state-dir", str(tmp_path), timeout_s=30)
    one_line_error(out, 2, f"{flags[0]} 0", "at least one prefill and one decode")


def test_a_service_that_dies_at_start_is_named_with_its_log(model, tmp_path):
    broken = copy_without(model, tmp_path / "broken")
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(b"not a safetensors file")  # passes the checks; the workers die loading it
    out = up("--model", str(broken), "--port", str(free_port()), "--state-dir", str(tmp_path / "state"))
    assert out.returncode == 1 and "Traceback" not in out.stderr.split("infermesh: error: ")[0]
    error = out.stderr[out.stderr.index("infermesh: error: "):].splitlines()
    # One line names the process and why; then the end of its log, which holds the cause.
    assert error[0].startswith(("infermesh: error: prefill-0 exited", "infermesh: error: decode-0 exited"))
    assert "while the mesh started" in error[0] and "not a readable safetensors file" in error[0]
    name = error[0].split()[2]
    assert error[1] == f"last lines of {tmp_path / 'state' / 'logs' / f'{name}.log'}:"
    assert 2 <= len([line for line in error[2:] if line.startswith("  | ")]) <= 12
    assert "InferMesh is up" not in out.stdout
    assert "stopping the mesh" in out.stderr


def test_a_good_start_shows_weights_and_services_coming_up(model, tmp_path):
    out = up("--model", str(model), "--port", str(free_port()), "--state-dir", str(tmp_path / "state"), "--demo")
    assert out.returncode == 0, out.stderr
    assert "InferMesh is up" in out.stdout
    # Its stderr is a pipe, not a terminal: one line per change, no redrawn bars.
    lines = out.stderr.splitlines()
    assert "\r" not in out.stderr
    model_name = model.name
    assert any(line.startswith("loading weights: ") and f"tensors of {model_name}, 2 workers" in line for line in lines)
    assert any(line.startswith("weights loaded: ") and f"tensors of {model_name}" in line for line in lines)
    ups = [line for line in lines if line.startswith("up: ")]
    assert len(ups) == 5 and ups[-1].endswith("(5/5 services)")
