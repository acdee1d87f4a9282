"""Settings of one engine instance."""

from dataclasses import dataclass

import torch

from shared.model.kernels import KERNEL_CHOICES

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    model: str
    """Folder of a Hugging Face format checkpoint."""
    dtype: str = "float32"
    """float32, bfloat16 or float16: weights and KV cache."""
    device: str = "cpu"
    block_size: int = 16
    """Tokens per KV block; also the granularity of prefix caching."""
    num_kv_blocks: int | None = None
    """Blocks in the KV pool; None sizes the pool from kv_cache_memory_bytes."""
    kv_cache_memory_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    max_model_len: int | None = None
    """None takes the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    seed: int = 0
    """Seed of the sampler for requests that bring no seed of their own."""
    load_progress: bool = False
    detokenize: bool = True
    """Produce text (and honour stop strings) in the engine; a mesh worker leaves
    that to the balancer and streams token ids only."""
    record_kv_events: bool = False
    """Keep the hashes of blocks entering / leaving the prefix cache for drain_kv_events()."""
    async_scheduling: bool | None = None
    """Schedule and launch step N+1 before reading step N's tokens back, so the
    device does not idle while the host prepares a step. None: on for CUDA.
    Batches with penalties, logprobs or min_tokens run step by step (they need
    every token on the host)."""
    cuda_graphs: bool = True
    """Replay decode steps from CUDA graphs (on CUDA with the Triton kernels); False runs them eagerly."""
    kernels: str = "auto"
    """Attention, norm, rotary and activation code: "auto" (Triton kernels on CUDA,
    PyTorch elsewhere), "triton" (on the CPU only under TRITON_INTERPRET=1) or "torch"."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {self.kernels!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
