"""EngineConfig.dtype as a torch dtype: where the engine's dtype names meet
torch, so that config.py stays torch-free."""

import torch

from shared.engine.config import DTYPES

_TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of one of config.DTYPES."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return _TORCH_DTYPES[name]
