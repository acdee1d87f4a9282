"""Argument checks shared by the kernel wrappers: every failure is a ValueError that
names the argument and says what was expected, raised before anything is launched."""

import os

import torch

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    shape: tuple[int | None, ...] | None = None,
    unit_last_stride: bool = True,
) -> None:
    """``shape`` entries of None are not checked. ``unit_last_stride``: the kernels index
    the last dimension with stride 1."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, t.shape)):
            if want is not None and want != got:
                raise ValueError(f"{name} has shape {tuple(t.shape)}: dimension {axis} must be {want}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")
    if unit_last_stride and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def check_device(device: torch.device) -> None:
    """CUDA, or the CPU under Triton's interpreter (which runs on CPU tensors)."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise ValueError(f"Triton kernels run on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got {device}")


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
