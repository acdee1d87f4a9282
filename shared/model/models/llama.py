"""One Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over a paged KV cache, and
the base the MoE families (``qwen3_moe``, ``gpt_oss``) build on: they change which
MLP a layer has (``LlamaForCausalLM.make_mlp``) and set data the shared parts read
(attention sinks, rope).

Parameter names are transformers' (``model.layers.N.self_attn.o_proj.weight``...),
except that q/k/v and gate/up are stacked into one matmul each (``qkv_proj``,
``gate_up_proj``); ``checkpoint_tensors`` maps every checkpoint name to where it
goes, so loading a checkpoint is still a name lookup. Architecture differences come from
``ModelConfig`` fields: biases, per-head q/k RMSNorm (Qwen3), sliding windows per
layer, tied embeddings.
"""

from collections.abc import Callable, Collection, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from shared.model.attention import AttentionPlan, paged_attention, plan_attention
from shared.model.config import ModelConfig
from shared.model.forward_batch import AttentionMetadata
from shared.model.interface import CausalLM, ModelEntry
from shared.model.layers import MLP, Linear, MergedLinear, RMSNorm, RotaryEmbedding, apply_rope
from shared.model.models.llama_config import CONFIG
from shared.model.moe import Experts, SparseMoE, counted_tokens
from shared.model.ops import TORCH_OPS, Ops, resolve_ops
from shared.model.parallel import SINGLE, ParallelContext, Shard
from shared.model.parallel_layers import (
    MergedColumnParallelLinear, ParallelMLP, RowParallelLinear, VocabParallelHead, kv_head_shard, vocab_embedding,
)  # fmt: skip
from shared.kv.spec import KVCacheLayout, kv_cache_layout

if TYPE_CHECKING:  # the kernel modules are imported only when a model selects them
    from shared.model.kernels.attention import TritonAttentionPlan
    from shared.model.multimodal import InputEmbeddings


def llama_kv_layout(config: ModelConfig) -> KVCacheLayout:
    """One KV group per attention kind: full-attention layers, and sliding-window layers by window."""
    return kv_cache_layout(config.sliding_windows)


class Attention(nn.Module):
    """``parallel``: this rank's heads only (its query heads and the KV heads they read,
    and GPT-OSS's sinks of its query heads); the heads' outputs are summed across the
    ranks by o_proj."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device, ops: Ops = TORCH_OPS,
        parallel: ParallelContext = SINGLE,
    ) -> None:  # fmt: skip
        super().__init__()
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_windows[layer_idx]
        hidden = config.hidden_size
        self.head_shard: Shard | None = None
        """This rank's query heads of the checkpoint's (None: all of them, one rank)."""
        if parallel.is_parallel:
            self.num_heads = parallel.split(config.num_attention_heads, "num_attention_heads")
            self.head_shard = Shard(0, parallel.tp_rank * self.num_heads, self.num_heads, config.num_attention_heads)
            q_size = self.num_heads * self.head_dim
            q_shard = Shard(0, parallel.tp_rank * q_size, q_size, config.num_attention_heads * self.head_dim)
            kv_shard = kv_head_shard(config.num_key_value_heads, self.head_dim, parallel)
            self.num_kv_heads = kv_shard.size // self.head_dim
            parts = {"q_proj": q_shard, "k_proj": kv_shard, "v_proj": kv_shard}
            self.qkv_proj: MergedLinear = MergedColumnParallelLinear(hidden, parts, config.qkv_bias, dtype, device, ops)
            self.o_proj: Linear = RowParallelLinear(q_shard.full, hidden, config.o_bias, dtype, device, ops, parallel,
                                                    "num_attention_heads")  # fmt: skip
        else:
            self.num_heads = config.num_attention_heads
            self.num_kv_heads = config.num_key_value_heads
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            shards = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
            self.qkv_proj = MergedLinear(hidden, shards, config.qkv_bias, dtype, device, ops)
            self.o_proj = Linear(q_size, hidden, config.o_bias, dtype, device, ops)
        # Qwen3 normalises each head of q and k before rope.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device, ops) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device, ops) if config.qk_norm else None
        # GPT-OSS: a learned logit per head that joins every softmax (no value).
        self.sinks = (
            nn.Parameter(torch.empty(self.num_heads, dtype=dtype, device=device), requires_grad=False)
            if config.attention_sinks
            else None
        )
        self._rotary = ops.rotary
        self._attention = ops.attention

    def loaded_shards(self, module_name: str) -> dict[str, Shard]:
        """The sinks of this rank's heads (one per head, split with them)."""
        if self.sinks is None or self.head_shard is None:
            return {}
        return {f"{module_name}.sinks": self.head_shard}

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        plan: "AttentionPlan | TritonAttentionPlan",
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self._rotary is not None and self._attention is not None:
            # One launch rotates q and k and stores k and v in the cache, then attention reads the cache.
            q = self._rotary.rotary_embedding_and_store_kv(q, k, v, cos, sin, kv_cache, meta.slot_mapping)
            out = self._attention.triton_attend(q, kv_cache, plan, self.sliding_window, self.scale, self.sinks)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            out = paged_attention(q, k, v, kv_cache, meta, plan, self.sliding_window, self.scale, self.sinks)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


MlpFactory = Callable[[ModelConfig, int, torch.dtype, torch.device, Ops], nn.Module]
"""(config, layer index, dtype, device, ops table) -> the layer's MLP module."""


def dense_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device, ops: Ops) -> nn.Module:
    return MLP(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype, device, ops)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device, ops: Ops = TORCH_OPS,
        make_mlp: MlpFactory = dense_mlp, norm_scale_in_float32: bool = False, parallel: ParallelContext = SINGLE,
    ) -> None:  # fmt: skip
        super().__init__()
        self.self_attn = Attention(config, layer_idx, dtype, device, ops, parallel)
        if parallel.is_parallel and config.mlp_layer_type(layer_idx) == "dense":
            self.mlp: nn.Module = ParallelMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype,
                                              device, ops, parallel)  # fmt: skip
        else:
            # A sparse layer under tensor parallelism is built whole: expert parallelism then
            # keeps this rank's experts (check_tensor_parallel refuses it without).
            assert not parallel.is_parallel or parallel.is_expert_parallel, "tensor parallelism splits dense MLPs only"
            self.mlp = make_mlp(config, layer_idx, dtype, device, ops)
        # Hash-routed experts are chosen by token id: a sparse MLP gets the input ids.
        self._mlp_takes_ids = isinstance(self.mlp, SparseMoE)
        norm = (config.hidden_size, config.rms_norm_eps, dtype, device, ops, norm_scale_in_float32)
        self.input_layernorm = RMSNorm(*norm)
        self.post_attention_layernorm = RMSNorm(*norm)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        plan: "AttentionPlan | TritonAttentionPlan",
        input_ids: torch.Tensor | None = None,
        counted: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's output, the residual stream before adding it): each residual add
        is fused into the next norm (the first layer gets residual None). ``counted``:
        the rows a sparse MLP counts per expert (``moe.counted_tokens``)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.fused_add(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, meta, plan)
        x, residual = self.post_attention_layernorm.fused_add(x, residual)
        if self._mlp_takes_ids:
            return self.mlp(x, input_ids, counted), residual
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """transformers' ``model.`` prefix: embeddings, layers, final norm."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device, ops: Ops = TORCH_OPS,
        make_mlp: MlpFactory = dense_mlp, norm_scale_in_float32: bool = False, parallel: ParallelContext = SINGLE,
    ) -> None:  # fmt: skip
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, dtype, device, parallel)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype, device, ops, make_mlp, norm_scale_in_float32, parallel)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, ops, norm_scale_in_float32)


def checkpoint_targets(root: nn.Module, available: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """``root``'s tensors by transformers' names under it: each parameter, the rows of
    a stacked projection (MergedLinear) by the names of its parts, the experts as
    stored (``available``: the checkpoint's names, where experts have two spellings).
    A model's checkpoint_tensors, and a vision instance's tower alone (tower_loader.py)."""
    merged = {name: m for name, m in root.named_modules() if isinstance(m, MergedLinear)}
    experts = {name: m for name, m in root.named_modules() if isinstance(m, Experts)}
    targets: dict[str, torch.Tensor] = {}
    for module_name, module in experts.items():
        targets.update(module.checkpoint_targets(module_name, available))
    for name, param in root.named_parameters():
        module_name = name.rpartition(".")[0]
        if module_name not in merged and module_name not in experts:
            targets[name] = param.detach()
    for module_name, module in merged.items():
        parent = module_name.rpartition(".")[0]
        targets.update({f"{parent}.{part}": view for part, view in module.shard_views().items()})
    return targets


class LlamaForCausalLM(CausalLM):
    """The Llama family's ``CausalLM`` (shared/model/interface.py), and the base of the
    families that only change the MLP (``make_mlp``) or the norms' precision.

    ``kernels`` ("auto", "triton", "torch"; see shared/model/kernels) picks the Triton
    kernels or the PyTorch path once, for the model's life; "auto" is Triton on CUDA.
    The rope frequencies stay float32 whatever ``dtype``. ``parallel``: build this rank's
    slice of a tensor-parallel model (``check_tensor_parallel``): the attention, the dense
    MLPs, the embedding and the head split over ``tp_size`` ranks. The MoE families' sparse
    layers split only by expert parallelism beside it (built whole here, their experts then
    kept per rank by ``make_expert_parallel``: vLLM's ``--tensor-parallel-size N
    --enable-expert-parallel``); their input, after o_proj's all-reduce, is the whole step
    on every rank, as the token-split MoE expects.
    """

    make_mlp: ClassVar[MlpFactory] = staticmethod(dense_mlp)
    splits_attention_with_experts = True
    norm_scale_in_float32: ClassVar[bool] = False
    """The layer and final norms' weights in float32, applied before the cast back (see RMSNorm)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tie_word_embeddings: bool | None = None,
        kernels: str = "auto",
        *,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__(
            config, dtype, config.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
        )
        device = torch.device(device)
        ops = resolve_ops(kernels, device)
        self.use_triton = ops.triton
        """Whether the forward runs Triton kernels (build_model's batch_invariant may swap in its table)."""
        self.parallel = parallel
        if parallel.is_parallel:
            type(self).check_tensor_parallel(config, parallel.tp_size, expert_parallel=parallel.is_expert_parallel)
        self.model = DecoderModel(config, dtype, device, ops, type(self).make_mlp, self.norm_scale_in_float32, parallel)
        sparse = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)]
        self._sparse_blocks: list[SparseMoE] = sparse
        if sparse and config.moe is not None:
            self.expert_counts = torch.zeros(len(sparse), config.moe.num_experts, dtype=torch.int64, device=device)
            for row, block in zip(self.expert_counts, sparse):
                block.counts = row
        self._triton_attention = ops.attention
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim, device)
        # Tied: no lm_head parameter at all, so the checkpoint's name list has no entry to fill.
        self.lm_head = None
        if not self.tie_word_embeddings and parallel.is_parallel:
            self.lm_head = VocabParallelHead(config.hidden_size, config.vocab_size, dtype, device, parallel)
        elif not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device)
        self.num_local_kv_heads = config.num_key_value_heads
        """KV heads in this rank's cache (all of them with one rank)."""
        if parallel.is_parallel:
            self.num_local_kv_heads = kv_head_shard(config.num_key_value_heads, 1, parallel).size
        self._gemv = ops.gemv
        self.kv_layout = llama_kv_layout(config)
        self._group_of_layer = [self.kv_layout.group_of_layer(i) for i in range(config.num_hidden_layers)]
        self._group_windows = [frozenset([g.spec.window]) for g in self.kv_layout.groups]

    @classmethod
    def check_tensor_parallel(cls, config: ModelConfig, tp_size: int, expert_parallel: bool = False) -> None:
        """Heads split evenly: num_attention_heads divisible by tp_size, and KV heads either
        split evenly or, where there are fewer than ranks, replicated (tp_size a multiple
        of them). Sparse (MoE) layers are expert parallelism's, not split here: an MoE
        family splits only with ``expert_parallel``."""
        if tp_size == 1:
            return
        if (cls.make_mlp is not dense_mlp or config.moe is not None) and not expert_parallel:
            raise ValueError(f"not implemented yet: tensor parallelism for {config.architecture} (MoE layers) "
                             "without enable_expert_parallel")  # fmt: skip
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        if heads % tp_size:
            raise ValueError(f"num_attention_heads ({heads}) is not divisible by tensor_parallel_size ({tp_size})")
        if kv % tp_size and tp_size % kv:
            raise ValueError(
                f"tensor_parallel_size ({tp_size}) must divide num_key_value_heads ({kv}) or be a multiple of it"
            )
        dense_layers = any(config.mlp_layer_type(i) == "dense" for i in range(config.num_hidden_layers))
        if dense_layers and config.intermediate_size % tp_size:
            raise ValueError(
                f"intermediate_size ({config.intermediate_size}) is not divisible by tensor_parallel_size ({tp_size})"
            )

    @property
    def kv_row_shape(self) -> tuple[int, int]:
        return self.num_local_kv_heads, self.config.head_dim

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether a decode step can be captured: the Triton path, and sparse layers only
        on the fused experts (the PyTorch path reads its run lengths on the host)."""
        return self.use_triton and all(block.host_sync_free for block in self._sparse_blocks)

    def checkpoint_tensors(self, available: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """Each tensor name of a transformers checkpoint -> the tensor to copy it into:
        a parameter, or its rows of a stacked projection (or a view of stacked experts).
        ``available``: the checkpoint's names, where a layout has two spellings (experts
        per expert or fused); None: the spelling transformers saves."""
        return checkpoint_targets(self, available)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metas: list[AttentionMetadata],
    ) -> torch.Tensor:
        """metas: the attention metadata of each KV cache group (``kv_layout.groups``):
        the groups share the batch and differ in block tables and slots."""
        if positions.dim() != 1:
            raise ValueError(f"positions {tuple(positions.shape)} must be one per token")
        return self.run_layers(self.model.embed_tokens(input_ids), input_ids, positions, kv_caches, metas)

    def run_layers(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metas: list[AttentionMetadata],
        added: "Sequence[InputEmbeddings]" = (),
    ) -> torch.Tensor:
        """The decoder over input embeddings ``x`` [T, hidden] (the token embeddings, or a
        vision-language model's with its images merged in); ``positions``: the rotary
        positions, [T] (or [3, T] for a multimodal rotary, ``rotary_emb`` reads them).
        ``added[i]``: rows whose hidden state after layer i gets those embeddings added
        (Qwen3-VL's deepstack: the tower's intermediate features at the image rows of
        the first layers); empty for every other model, whose loop is unchanged."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        if len(metas) != len(self.kv_layout.groups):
            raise ValueError(f"got attention metadata for {len(metas)} KV groups, the model has {len(self.kv_layout.groups)}")
        meta = metas[0]
        if input_ids.shape[0] != meta.query_start_loc[-1] or positions.shape[-1] != input_ids.shape[0]:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must both have "
                f"query_start_loc[-1]={meta.query_start_loc[-1]} tokens"
            )
        cos, sin = self.rotary_emb(positions, x.dtype)
        plans: list[AttentionPlan] | list[TritonAttentionPlan]
        if self._triton_attention is not None:
            c = self.config
            plan_group = self._triton_attention.plan_triton_attention
            plans = [plan_group(m, self.num_local_kv_heads, c.head_dim, x.device) for m in metas]
        else:
            plans = [plan_attention(m, w, x.device) for m, w in zip(metas, self._group_windows)]
        residual: torch.Tensor | None = None
        counted = counted_tokens(meta, input_ids.shape[0]) if self._sparse_blocks else None
        for i, (layer, kv_cache, g) in enumerate(zip(self.model.layers, kv_caches, self._group_of_layer)):
            x, residual = layer(x, residual, cos, sin, kv_cache, metas[g], plans[g], input_ids, counted)
            if i < len(added):
                # The layer's output summed into the stream (as the next norm's fused add
                # would), the rows added to, and handed on as a fresh stream: the same
                # adds, in the same order, as transformers' decoder loop.
                assert residual is not None
                x, residual = (x + residual).index_add(0, added[i].rows, added[i].embeds.to(x.dtype)), None
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm.fused_add(x, residual)[0]


ENTRY = ModelEntry(
    config=CONFIG,
    model_classes=MappingProxyType(dict.fromkeys(CONFIG.architectures, LlamaForCausalLM)),
    kv_layout=llama_kv_layout,
)
