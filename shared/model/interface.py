"""What the engine needs of any model, and what a model file exports.

``CausalLM`` is the interface the engine (shared/engine: the model runner, CUDA
graphs, speculative decoding) and the loader program against: a forward over the
paged KV cache, ``compute_logits``, the KV layout (``kv_layout``,
``allocate_kv_cache``, ``kv_bytes_per_block``), ``checkpoint_tensors`` for the
loader, the expert counts of a sparse model, and whether a decode step can be
captured in a CUDA graph. Its constructor sets the fields every model has; the
methods that are the same for every model (the logits, the cache allocation) live
here once, over the two facts a model declares (``lm_head`` / embeddings and the
shape of a cache row).

A model whose caches' rows differ (DeepSeek-V4) declares them in its layout
(``KVCacheLayout.rows``): each size class then has tensors of its own rows, none padded
to the widest (shared/kv/spec.py).

``ModelEntry`` is what each file in shared/model/models exports as ``ENTRY`` (SGLang's
``EntryClass``): its torch-free config (architectures, parser, test configs), its
model class and its KV layout declaration. The registry (shared/model/models)
collects them; nothing else keeps a list of architectures.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from shared.kv.spec import CacheRow, KVCacheLayout
from shared.model.arch_config import ArchConfig
from shared.model.config import ModelConfig
from shared.model.forward_batch import AttentionMetadata
from shared.model.layers import Linear, linear
from shared.model.parallel import SINGLE, ParallelContext, Shard

TensorMaker = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
"""(shape, dtype) -> a zeroed tensor (e.g. in memory another process can map)."""
CheckpointNames = Callable[[Collection[str]], Mapping[str, str | None]]
"""A checkpoint's tensor names (quantised pairs already folded into one) -> the name
``checkpoint_tensors`` knows each by, or None for a tensor that is not the model's (set
aside, e.g. DeepSeek's ``mtp.*`` for the MTP drafter)."""


def same_names(names: Collection[str]) -> Mapping[str, str | None]:
    """The default ``ModelEntry.checkpoint_names``: a family with one spelling."""
    return {name: name for name in names}


class CausalLM(nn.Module, ABC):
    """The engine's model: ``forward`` returns final-normed hidden states [T, hidden];
    ``compute_logits`` maps the rows the caller keeps (usually the last token of each
    sequence) to float32 logits.

    A model is built in its final dtype and device (``load_model`` does): parameters
    start uninitialised. A subclass's constructor calls this one first, then builds
    its modules, setting ``model.embed_tokens``, ``lm_head`` (None when tied),
    ``kv_layout`` and, for a sparse model, ``expert_counts``."""

    model: nn.Module
    """transformers' ``model.`` prefix: at least ``embed_tokens``."""
    lm_head: Linear | None
    """None: the head is tied to ``model.embed_tokens`` (no parameter to load)."""
    kv_layout: KVCacheLayout
    """The model's KV cache groups: which layers share a block table, and what each keeps."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tie_word_embeddings: bool) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tie_word_embeddings = tie_word_embeddings
        self.expert_counts: torch.Tensor | None = None
        """[sparse layers, experts] int64 on the model's device: the (token, choice) pairs
        each expert got in the last forward, counted on the device (no sync); read it back
        with a non-blocking copy after the step. None for a dense model."""
        self._gemv: Callable[..., torch.Tensor] | None = None
        """The logits' product kernel (None: PyTorch's)."""
        self.batch_invariant = False
        """Whether ``build_model`` installed the batch-invariant ops table (shared/model/batch_invariant.py)."""
        self.parallel: ParallelContext = SINGLE
        """This rank's slice (a family that splits sets it from its ``parallel=``): with
        tp_size > 1 its head is vocab-parallel and ``compute_logits`` gathers the logits."""

    splits_attention_with_experts: ClassVar[bool] = False
    """Whether, under expert parallelism without data-parallel attention, the family runs
    its attention and dense layers tensor-parallel over the ranks beside its
    expert-parallel MoE layers (vLLM's ``--tensor-parallel-size N --enable-expert-parallel``).
    False: its attention is replicated on every rank."""
    splits_kv_heads: ClassVar[bool] = True
    """Whether tensor-parallel attention splits the KV cache by KV head (each rank's cache
    holds its heads, ``kv_heads_of_rank``). False: every rank's cache holds the whole KV
    (DeepSeek-V4: one KV head shared by every query head, and the compressed caches, all
    computed on every rank), and the instance's KV moves as one rank's."""

    @classmethod
    def check_tensor_parallel(cls, config: ModelConfig, tp_size: int, expert_parallel: bool = False) -> None:
        """A ValueError saying why ``config`` cannot be split over ``tp_size`` ranks; called
        before any rank starts. A family that splits its layers (shared/model/parallel_layers.py)
        overrides it; the others refuse. ``expert_parallel``: its MoE layers are expert
        parallelism's (split by expert), only the rest is split here."""
        if tp_size > 1:
            raise ValueError(f"not implemented yet: tensor parallelism for {config.architecture}")

    def checkpoint_shards(self) -> dict[str, Shard]:
        """Checkpoint name -> the slice of it this rank's tensor holds, for every tensor
        split across tensor-parallel ranks (empty with one rank): collected from the
        modules that declare ``loaded_shards(module_name)``."""
        shards: dict[str, Shard] = {}
        for name, module in self.named_modules():
            declare = getattr(module, "loaded_shards", None)
            if declare is not None:
                shards.update(declare(name))
        return shards

    @property
    @abstractmethod
    def supports_cuda_graphs(self) -> bool:
        """Whether a decode step can be captured in a CUDA graph."""

    @property
    def kv_row_shape(self) -> tuple[int, int]:
        """(heads, channels) of one token's row in every cache tensor, for a model whose
        layout declares no rows (every cache alike, two planes: K and V)."""
        raise NotImplementedError(f"{type(self).__name__} declares its cache rows in kv_layout.rows")

    def _default_row(self) -> CacheRow | None:
        """The row of every cache when the layout declares none."""
        return CacheRow(2, *self.kv_row_shape) if self.kv_layout.rows is None else None

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], metas: list[AttentionMetadata]
    ) -> torch.Tensor:
        """Hidden states [T, hidden]; ``kv_caches`` as ``allocate_kv_cache`` made them,
        ``metas`` the attention metadata of each KV group (``kv_layout.groups``)."""

    @abstractmethod
    def checkpoint_tensors(self, available: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """Each tensor name of a checkpoint -> the tensor to copy it into. ``available``:
        the checkpoint's names, where a layout has two spellings; None: the spelling
        transformers saves."""

    @torch.inference_mode()
    def draft_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states an MTP drafter reads for the rows of the last forward, whose
        output is ``hidden``: that output itself (final-normed), unless the family's MTP
        module reads something else (DeepSeek-V4: the streams before its hyper head)."""
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The product runs in the model dtype, then widens, as transformers' lm_head does;
        # greedy decoding then picks the same token as transformers in bf16 too.
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight, None, self._gemv).float()
        if not self.parallel.is_parallel:
            return logits
        # Every rank gets every logit (vLLM v1's all-gather): each samples the same tokens
        # from the same numbers, so no rank waits for another's tokens.
        gathered = self.parallel.all_gather(logits)
        vocab = self.config.vocab_size
        return gathered if gathered.shape[-1] == vocab else gathered[:, :vocab].contiguous()

    def allocate_kv_cache(
        self,
        num_blocks: int | Sequence[int],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        make: TensorMaker | None = None,
    ) -> list[torch.Tensor]:
        """The KV cache of every cache layer: per size class (``kv_layout.size_classes``;
        one for a model whose caches are alike; ``num_blocks`` blocks each, or per class)
        zeroed tensors ``[planes, num_blocks,
        block_rows, heads, channels]`` of its rows (block_rows: block_size, or a compressed
        group's entries per block, ``KVCacheLayout.block_rows``), layer k of each group of the class
        using the class's tensor k (a block id of the class names the same memory
        whichever of its groups holds it). A class of one row shape is views of one
        tensor ``[tensors, planes, num_blocks, ...]`` (their ``_base``), so a block of
        every layer moves in one copy; a class of mixed rows is one tensor per row.

        Zeroed, not empty: a masked key still enters the attention matmul with weight 0,
        and 0 * NaN from uninitialised memory would be NaN. ``make(shape, dtype)``, when
        given, makes each zeroed tensor instead (e.g. in memory another process can map).
        """
        layout = self.kv_layout

        def zeros(shape: tuple[int, ...]) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device) if make is None else make(shape, dtype)

        class_rows = layout.class_rows(self._default_row())
        counts = [num_blocks] * len(class_rows) if isinstance(num_blocks, int) else list(num_blocks)
        if len(counts) != len(class_rows):
            raise ValueError(f"{len(counts)} block counts for {len(class_rows)} size classes")
        tensors: list[torch.Tensor] = []
        for size_class, (rows, n) in enumerate(zip(class_rows, counts)):
            block_rows = layout.block_rows(size_class, block_size)
            if len(set(rows)) == 1:
                row = rows[0]
                tensors += zeros((len(rows), row.planes, n, block_rows, row.heads, row.channels)).unbind(0)
            else:
                tensors += [zeros((r.planes, n, block_rows, r.heads, r.channels)) for r in rows]
        return [tensors[layout.tensor_index(i)] for i in range(layout.num_layers)]

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block id takes in every size class together: the cache's bytes per
        block where every class has as many blocks."""
        return sum(self.kv_class_bytes_per_block(block_size, dtype))

    def kv_class_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> list[int]:
        """Bytes a block of each size class takes."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return [e * element_size for e in self.kv_layout.class_elements_per_block(block_size, self._default_row())]


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """What a model file exports as ``ENTRY``; the registry (shared/model/models) reads nothing else."""

    config: ArchConfig
    """The torch-free part (``models/<name>_config.py``): architectures, parser, test configs."""
    model_classes: Mapping[str, type[CausalLM]]
    """HF architecture name -> the class that serves it, for every name of ``config``. A
    class is built as ``cls(config, dtype, device, tie_word_embeddings, kernels)``, and
    with ``parallel=`` (a ``ParallelContext``) where it passed ``check_tensor_parallel``."""
    kv_layout: Callable[[ModelConfig], KVCacheLayout]
    """The model's KV cache groups, from its config alone (no model built)."""
    checkpoint_names: CheckpointNames = same_names
    """How the loader maps a released checkpoint's names onto ``checkpoint_tensors``' (a
    family whose checkpoints come in several spellings, DeepSeek-V4's, says here)."""

    def __post_init__(self) -> None:
        if set(self.model_classes) != set(self.config.architectures):
            raise ValueError(
                f"model classes for {sorted(self.model_classes)}, configs for {sorted(self.config.architectures)}"
            )
