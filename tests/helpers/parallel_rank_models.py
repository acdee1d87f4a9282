"""Each rank's model as an instance's ranks build it (the executor's process group and
``load_rank_model``), in spawned gloo processes: what a test inspects of each rank's
slice (shapes, loaded tensors) without running the engine. Module-level functions, so a
spawned process can import them."""

from pathlib import Path
from typing import Any

import torch

from shared.engine.config import EngineConfig
from shared.engine.executor.process_group import instance_context, join_store
from shared.engine.executor.rank import load_rank_model, splits_attention
from shared.model.interface import CausalLM
from shared.model.loader import read_config
from tests.helpers.tensor_parallel import spawn_ranks

RankReport = dict[str, Any]
"""Each parameter's name -> its shape; "kv_row_shape" (where the layout declares no rows
of its own: DeepSeek-V4's are its config's, the same on every rank); "sinks": layer 0's
attention sinks' values (a list), where the model has them."""


def _report(model: CausalLM) -> RankReport:
    params = dict(model.named_parameters())
    out: RankReport = {name: tuple(param.shape) for name, param in params.items()}
    if model.kv_layout.rows is None:
        out["kv_row_shape"] = tuple(model.kv_row_shape)
    sinks = params.get("model.layers.0.self_attn.sinks")
    if sinks is not None:
        out["sinks"] = sinks.float().tolist()
    return out


def _rank(rank: int, config: EngineConfig, port: int, results: Any) -> None:
    torch.set_num_threads(1)  # the ranks share the host's few cores
    world_size = config.num_ranks
    store = join_store(port, world_size)
    tp_attention = splits_attention(config, read_config(Path(config.model)))
    parallel = instance_context(store, rank, world_size, torch.device("cpu"), config.enable_expert_parallel,
                                tp_attention)  # fmt: skip
    model = load_rank_model(config, parallel, torch.device("cpu"), progress=False)
    results.put((rank, _report(model)))


def rank_model_reports(config: EngineConfig, timeout_s: float = 120.0) -> list[RankReport]:
    """Per rank (in rank order): what ``RankReport`` says of its model."""
    return spawn_ranks(_rank, config.num_ranks, (config,), (), timeout_s)
