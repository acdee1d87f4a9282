"""Inputs for DeepSeek-V4's compressed-attention kernel and the PyTorch path it replaces
(compressed_batch: window_keys, the entry gather, attend_rows), shared by the interpreter
test (tests/parity/test_compressed_attention_kernel.py) and the GPU one. Importing this
imports no kernel: the caller imports shared.model.kernels.compressed_attention after
choosing whether Triton interprets."""

from typing import Any

import torch

from shared.model.compressed_batch import TokenRows, attend_rows, window_keys

BLOCK = 4
WINDOW = 8


def kernel_case(
    heads: int, head_dim: int, picks: int, floor: bool, dtype: torch.dtype, seed: int, device: str = "cpu"
) -> dict[str, Any]:
    """Rows of three sequences (KV lengths 13, 21, 6; their last 5, 7, 6 tokens are the
    rows) over scattered blocks of 4 tokens, a window of 8; state and entry rows wider than
    the head (channels past it must not be read), the state rows a strided view as the
    model's state plane is; row 3 sees no entry; with ``floor``, sequence 1 replays from
    position 17 (keys before it have no KV); sinks large enough to matter."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 24
    seq_lens, query_lens = [13, 21, 6], [5, 7, 6]
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:6] for _ in seq_lens])
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(query_lens))
    pos = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens)])
    state = torch.randn(num_blocks * BLOCK, head_dim + 24, generator=g).to(dtype)
    entries = torch.randn(40, head_dim + 8, generator=g).to(dtype)
    num_rows = pos.shape[0]
    chosen = torch.randint(0, 40, (num_rows, picks), generator=g)
    visible = torch.rand(num_rows, picks, generator=g) < 0.7
    visible[3] = False
    case: dict[str, Any] = {
        "query": torch.randn(num_rows, heads, head_dim, generator=g).to(dtype),
        "state": state[:, 4:],
        "state_tables": tables,
        "seq": seq,
        "pos": pos,
        "floor": torch.where(seq == 1, 17, 0) if floor else None,
        "entries": entries if picks else None,
        "picks": chosen if picks else None,
        "visible": visible if picks else None,
        "sinks": (3.0 * torch.randn(heads, generator=g)).float(),
    }
    case = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    return {**case, "scale": head_dim**-0.5, "max_len": max(seq_lens), "window": WINDOW, "block_size": BLOCK}


def reference(case: dict[str, Any]) -> torch.Tensor:
    """The model's PyTorch path: every row's keys gathered, then attend_rows."""
    head_dim = case["query"].shape[-1]
    rows = TokenRows(case["seq"], case["pos"], case["floor"], case["max_len"])
    keys, visible = window_keys(case["state"], case["state_tables"], rows, case["window"], case["block_size"], head_dim)
    if case["entries"] is not None:
        keys = torch.cat([keys, case["entries"][case["picks"], :head_dim]], dim=1)
        visible = torch.cat([visible, case["visible"]], dim=1)
    return attend_rows(case["query"], keys, visible, case["scale"], case["sinks"])


def run_kernel(kernel: Any, case: dict[str, Any], **tiles: int) -> torch.Tensor:
    """kernel: shared.model.kernels.compressed_attention.compressed_attention."""
    return kernel(
        case["query"], case["state"], case["state_tables"], case["seq"], case["pos"], case["floor"], case["window"],
        case["block_size"], case["entries"], case["picks"], case["visible"], case["sinks"], case["scale"], **tiles,
    )  # fmt: skip


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference over the output's scale (at least 1)."""
    return (got.float() - want.float()).abs().max().item() / max(1.0, want.float().abs().max().item())
