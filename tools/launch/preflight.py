"""What `infermesh up` checks before it starts anything, each failure one line
that says what is wrong and what to do: the instance counts, the model folder
(config.json the mesh can read, safetensors weights, the tokenizer the balancer
needs), how its instances split over ranks, the API port free, nats-server installed. A process started later finds
none of these problems, so its log is never the first place a user has to look."""

import errno
import socket
from pathlib import Path


class PreflightError(ValueError):
    """Why the mesh cannot start, in one line."""


def check_instances(num_prefill: int, num_decode: int) -> None:
    for flag, count in (("--prefill", num_prefill), ("--decode", num_decode)):
        if count < 1:
            raise PreflightError(
                f"{flag} {count}: the mesh needs at least one prefill and one decode instance to serve a request"
            )


def check_parallel(model: str, tensor_parallel_size: int, enable_expert_parallel: bool,
                   data_parallel_size: int = 1) -> None:  # fmt: skip
    """Instances of several ranks (--tensor-parallel-size N, --data-parallel-size N,
    --enable-expert-parallel)
    run in the mesh: each instance's connector moves every rank's KV (rank 0 maps the
    others' caches, shared/kv/memory/ranked_region.py), so a handoff between two of them,
    or to and from kvcache, carries the whole KV. Refused here, before anything starts,
    is what an instance would refuse at start: a model that does not split over N
    ranks (its heads, its experts), expert parallelism without an MoE model or over
    one rank. Runs after check_model (the config is readable). Not refused, with a
    line in the instance's log: NIXL, which reads one process's cache and so cannot
    carry rank shards, turns itself off for a multi-rank instance (KV across
    namespaces then comes from kvcache); a direct copy between instances of different
    splits is declined (the decode side loads from kvcache)."""
    from shared.engine.config import EngineConfig
    from shared.engine.executor.rank import check_split
    from shared.model.loader import read_config

    flag = f"--tensor-parallel-size {tensor_parallel_size}"
    if data_parallel_size > 1:
        flag += f" --data-parallel-size {data_parallel_size}"
    try:
        config = EngineConfig(model=model, tensor_parallel_size=tensor_parallel_size,
                              enable_expert_parallel=enable_expert_parallel, data_parallel_size=data_parallel_size)
        if config.num_ranks > 1:
            check_split(config, read_config(Path(model)))
    except ValueError as exc:
        raise PreflightError(f"{flag}: {exc}") from None


def check_model(model: str) -> None:
    """A Hugging Face checkpoint folder the mesh can serve."""
    folder = Path(model)
    if not folder.exists():
        raise PreflightError(f"the model folder {folder} does not exist: give --model a checkpoint folder "
                             "(or leave --model out for the seeded default)")  # fmt: skip
    if not folder.is_dir():
        raise PreflightError(f"--model {folder} is a file: give the checkpoint's folder")
    if not (folder / "config.json").is_file():
        raise PreflightError(f"no config.json in {folder}: --model takes a Hugging Face checkpoint folder")
    from shared.model.config import ModelConfig

    try:
        ModelConfig.from_pretrained(folder)
    except (ValueError, KeyError, TypeError) as exc:  # the json, or a model this mesh does not run
        raise PreflightError(f"{folder / 'config.json'} cannot be served: {exc}") from None
    if not any(folder.glob("*.safetensors")):
        raise PreflightError(f"no weights in {folder}: the mesh loads *.safetensors files (convert .bin or .pt first)")
    if not (folder / "tokenizer.json").is_file():
        raise PreflightError(f"no tokenizer.json in {folder}: the balancer needs a fast (tokenizers) tokenizer")


def check_port(host: str, port: int) -> None:
    """The API port is free: otherwise the balancer would die at start, or a health
    check would reach whatever listens there and call the mesh up."""
    if not 0 < port < 65536:
        raise PreflightError(f"--port {port} is not a TCP port (1-65535)")
    with socket.socket() as s:
        # As uvicorn binds: connections of a mesh just stopped (TIME_WAIT) do not hold the port.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PreflightError(f"port {port} on {host} is in use (another server?): stop it or choose "
                                     "another --port") from None  # fmt: skip
            if exc.errno == errno.EACCES:
                raise PreflightError(f"port {port} on {host} needs privileges: choose a port above 1023") from None
            raise PreflightError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def preflight(model: str, num_prefill: int, num_decode: int, host: str, port: int, tensor_parallel_size: int = 1,
              enable_expert_parallel: bool = False, data_parallel_size: int = 1) -> None:  # fmt: skip
    """Every check, cheapest first; raises PreflightError at the first failure."""
    from tools.launch.up import find_nats_server

    check_instances(num_prefill, num_decode)
    check_port(host, port)
    check_model(model)
    check_parallel(model, tensor_parallel_size, enable_expert_parallel, data_parallel_size)
    try:
        find_nats_server()
    except FileNotFoundError as exc:
        raise PreflightError(str(exc)) from None
