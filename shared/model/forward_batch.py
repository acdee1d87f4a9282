"""The one contract between the model runner (which builds it) and the model
(which reads it): a flattened, variable-length batch over a paged KV cache.

Tokens of all sequences in a step are concatenated ("varlen"): sequence ``s``
owns query rows ``query_start_loc[s]:query_start_loc[s+1]``. Those are its
newest tokens; its KV after the step covers ``seq_lens[s]`` tokens, the first
``seq_lens[s] - query_len`` of which are already in the cache.

The KV cache of one layer is a tensor ``[2, num_blocks, block_size,
num_kv_heads, head_dim]`` (0 = keys, 1 = values). Token ``t`` of a sequence
lives in block ``block_tables[s, t // block_size]`` at offset
``t % block_size``; ``slot_mapping`` is that flat slot
(``block_id * block_size + offset``) for every new token, where the model
writes its K/V before attending.
"""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, on the model's device
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, padded with 0
    query_start_loc: list[int]  # [num_seqs + 1] cumulative query lengths
    seq_lens: list[int]  # [num_seqs] KV length of each sequence after this step
    block_size: int
    # The two lists above as int32 device tensors, for the Triton kernels (which read
    # lengths on the device, never on the host). None: built from the lists per forward.
    query_start_loc_tensor: torch.Tensor | None = None
    seq_lens_tensor: torch.Tensor | None = None
    key_floor: list[int] | None = None
    """Sliding-window layers only: per sequence, the first key position whose KV exists
    (a request replaying from s after a prefix hit has no sliding-window KV before s),
    so a query at i sees keys [max(floor, i - W + 1), i]. None: 0 for every sequence."""
    key_floor_tensor: torch.Tensor | None = None
    """key_floor as an int32 device tensor, for the Triton kernels."""
    scratch_slot: int | None = None
    """Set only in a CUDA graph's step (shared/engine/cuda_graphs.py): a slot no request
    owns, where writes that must not land go. Its presence also says that the host lists
    above are the capture's bounds (seq_lens = max_model_len), not this step's lengths: a
    model reads the step's lengths from the tensors only."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> list[int]:
        q = self.query_start_loc
        return [q[i + 1] - q[i] for i in range(len(q) - 1)]
