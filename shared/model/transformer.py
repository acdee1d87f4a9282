"""One Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over a paged KV cache.

Parameter names are transformers' (``model.layers.N.self_attn.q_proj.weight``...),
so loading a checkpoint is a name lookup. Architecture differences come from
``ModelConfig`` fields: biases, per-head q/k RMSNorm (Qwen3), sliding windows per
layer, tied embeddings.
"""

import torch
from torch import nn

from shared.model.attention import AttentionPlan, paged_attention, plan_attention
from shared.model.config import ModelConfig
from shared.model.forward_batch import AttentionMetadata
from shared.model.layers import MLP, Linear, RMSNorm, RotaryEmbedding, apply_rope


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_windows[layer_idx]
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(hidden, q_size, config.qkv_bias, dtype, device)
        self.k_proj = Linear(hidden, kv_size, config.qkv_bias, dtype, device)
        self.v_proj = Linear(hidden, kv_size, config.qkv_bias, dtype, device)
        self.o_proj = Linear(q_size, hidden, config.o_bias, dtype, device)
        # Qwen3 normalises each head of q and k before rope.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, meta, plan, self.sliding_window, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, dtype, device)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """transformers' ``model.`` prefix: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        # _weight skips nn.Embedding's random init, which costs seconds on a large vocabulary.
        weight = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight, _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class CausalLM(nn.Module):
    """``forward`` returns final-normed hidden states [T, hidden]; ``compute_logits`` maps the
    rows the caller keeps (usually the last token of each sequence) to float32 logits.

    Build it in its final dtype and device (``load_model`` does): parameters start
    uninitialised, and the rope frequencies must stay float32.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tie_word_embeddings: bool | None = None,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.tie_word_embeddings = config.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
        self.model = DecoderModel(config, dtype, device)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim, device)
        # Tied: no lm_head parameter at all, so the checkpoint's name list has no entry to fill.
        self.lm_head = None if self.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, False, dtype, device)
        self._windows = frozenset(config.sliding_windows)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        if input_ids.shape[0] != meta.query_start_loc[-1] or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must both have "
                f"query_start_loc[-1]={meta.query_start_loc[-1]} tokens"
            )
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        plan = plan_attention(meta, self._windows, x.device)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, meta, plan)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The product runs in the model dtype, then widens, as transformers' lm_head does;
        # greedy decoding then picks the same token as transformers in bf16 too.
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> list[torch.Tensor]:
        """One zeroed ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer.

        Zeroed, not empty: a masked key still enters the attention matmul with weight 0,
        and 0 * NaN from uninitialised memory would be NaN.
        """
        c = self.config
        shape = (2, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_hidden_layers)]

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers (keys and values)."""
        c = self.config
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * block_size * c.num_key_value_heads * c.head_dim * element_size * c.num_hidden_layers
