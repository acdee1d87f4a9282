"""The engines the CUDA graph tests compare (tests/gpu/test_gpu_v4_graphs.py,
test_gpu_spec_graphs.py): one LLM on the device with or without decode graphs, and
a record of the rows each graph replay was handed (every bucket is captured at
start, so replays, not captures, show which steps ran graphed)."""

from pathlib import Path
from typing import Any

from shared.engine.cuda_graphs import DecodeGraphs
from shared.engine.llm import LLM

MAX_NUM_SEQS = 8
"""The graphed tests' batch: their largest graph bucket."""


def cuda_llm(path: Path, dtype: str, cuda_graphs: bool, **config: Any) -> LLM:
    """An LLM on the CUDA device; ``config``: the EngineConfig fields a test adds."""
    return LLM(str(path), dtype=dtype, device="cuda", cuda_graphs=cuda_graphs, max_num_seqs=MAX_NUM_SEQS, **config)


def record_replays(graphs: DecodeGraphs | None) -> list[int]:
    """Wraps graphs.run on the instance: the list fills with each replay's row count."""
    assert graphs is not None, "the engine captured no CUDA graphs"
    rows: list[int] = []
    replay = graphs.run

    def run(**kwargs: Any) -> Any:
        rows.append(len(kwargs["input_ids"]))
        return replay(**kwargs)

    graphs.run = run  # type: ignore[method-assign]
    return rows
