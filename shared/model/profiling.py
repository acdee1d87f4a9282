"""Profiler ranges over a model's parts, for tools that cut a step by kind
(tools/bench/v4_bench.py sums the kernels launched under each range)."""

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.profiler import record_function


def profiled(name: str) -> AbstractContextManager[object]:
    """A profiler range ``name`` while a torch profiler records, else nothing:
    record_function alone costs several microseconds a call even with no profiler."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()
