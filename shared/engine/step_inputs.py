"""A step's inputs onto the device without waiting for the device.

``torch.tensor(values, device="cuda")`` copies from pageable memory, and such a
copy is ordered after every kernel already queued: the host blocks until the
device has finished them. In an overlapped step loop that is exactly the gap the
overlap exists to hide, so every list the engine sends to the device per step
goes through pinned memory (PyTorch's caching host allocator: no allocation
once warm, and a block is not reused before its copy has run) and an
asynchronous copy.
"""

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a list, or a list of equal-length lists) as a ``dtype`` tensor on
    ``device``; returns at once on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def fill_placeholders(input_ids: torch.Tensor, sources: torch.Tensor, last_tokens: torch.Tensor) -> torch.Tensor:
    """input_ids with each row i whose ``sources[i] >= 0`` replaced by
    ``last_tokens[sources[i]]``: a token the step before sampled and that is still on
    the device (async scheduling schedules with a placeholder in its place)."""
    if last_tokens.numel() == 0:
        return input_ids
    picked = last_tokens[sources.clamp(min=0, max=last_tokens.numel() - 1)]
    return torch.where(sources >= 0, picked, input_ids)
