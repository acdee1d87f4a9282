"""Image embeddings as kvcache blobs: how the vision stage stores a tower's output
under the image's identity and prefill and decode read it back (E/P/D).

A blob's layout names the format, the dtype, the shape and the image's (t, h, w)
grid; its data is the tensor's bytes, row-major. The grid travels with the
embeddings so that a stage holding only the image's identity places it (M-RoPE
positions) without running the processor again.

kvcache is the one transfer path every deployment has; on the vision instance's host
and PID namespace the same blobs are copied straight out of its shared memory
(shared/stage/embedding_share.py, the mapping KV's direct copy uses), elsewhere READ
out of it through NIXL where the instance offers that (shared/stage/embedding_nixl.py,
vision.nixl), and only the rest are asked of kvcache."""

import asyncio
import logging
from collections.abc import Mapping, Sequence

import torch

from shared.engine.dtypes import torch_dtype
from shared.kv.wire.client import KVCacheClient
from shared.model.multimodal import ImageEmbeddings
from shared.model.vision.mrope import GridTHW

log = logging.getLogger(__name__)

FORMAT = "emb1"


def to_blob(embeds: torch.Tensor, grid: GridTHW) -> tuple[str, bytes]:
    """(layout, data) of one image's embeddings [tokens, hidden]."""
    embeds = embeds.detach().to("cpu").contiguous()
    dtype = str(embeds.dtype).removeprefix("torch.")
    rows, hidden = embeds.shape
    layout = f"{FORMAT};{dtype};{rows}x{hidden};{'x'.join(str(int(g)) for g in grid)}"
    return layout, embeds.view(torch.uint8).numpy().tobytes()


def from_blob(layout: str, data: bytes) -> tuple[torch.Tensor, GridTHW]:
    """The embeddings and grid of to_blob's layout and data; ValueError if they do not add up."""
    try:
        fmt, dtype_name, shape, grid_text = layout.split(";")
        rows, hidden = (int(v) for v in shape.split("x"))
        t, h, w = (int(v) for v in grid_text.split("x"))
        dtype = torch_dtype(dtype_name)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"not an embeddings layout: {layout!r} ({exc})") from None
    if fmt != FORMAT:
        raise ValueError(f"embeddings format {fmt!r}, this code reads {FORMAT!r}")
    expected = rows * hidden * torch.empty((), dtype=dtype).element_size()
    if len(data) != expected:
        raise ValueError(f"{len(data)} bytes of embeddings where {layout!r} says {expected}")
    embeds = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(rows, hidden)
    return embeds, (t, h, w)


async def fetch_embeddings(
    client: KVCacheClient, hashes: Sequence[bytes], timeout_s: float,
    held: Mapping[bytes, tuple[str, bytes]] | None = None,
) -> ImageEmbeddings | None:
    """The images' embeddings, in order: held's blobs (read another way: the direct
    path), the rest from kvcache; None when any is missing (the caller encodes them
    itself). Errors of kvcache propagate, and ValueError for a blob that does not add up."""
    held = held or {}
    rest = [h for h in dict.fromkeys(hashes) if h not in held]
    found = {**(await client.get_blobs(rest, timeout_s=timeout_s) if rest else {}), **held}
    if any(h not in found for h in hashes):
        return None
    parsed = await asyncio.to_thread(lambda: [from_blob(*found[h]) for h in hashes])
    return ImageEmbeddings(tuple(e for e, _ in parsed), tuple(g for _, g in parsed))
