"""A multi-token-prediction (MTP) head in DeepSeek-V3's layout, for Llama-family targets.

One MTP layer predicts the token after next. At position i it takes the target's
final hidden state h_i (after the model's final norm: what vLLM's and SGLang's
DeepSeek MTP receive as ``previous_hidden_states``, since their DeepSeek forward
returns the normed states) and the embedding of token t_{i+1}, and predicts t_{i+2}:

    x   = eh_proj(concat[enorm(embed(t_{i+1})), hnorm(h_i)])   # embedding first
    o_i = block(x)                     # one decoder layer of the target's kind, own KV
    p(t_{i+2}) = softmax(head(shared_head.norm(o_i)))

The embedding and the LM head are the target's (DeepSeek shares them; its checkpoints
store copies, which must equal the target's). o_i stands in for the target's hidden
state at i + 1 when the layer is applied again for a further token (DeepSeek reuses
its one MTP layer recursively).

Checkpoint names are DeepSeek-V3's, as the layer after the last one
(L = ``num_hidden_layers``; ``num_nextn_predict_layers`` in config.json >= 1 says they
are there; the first is used): ``model.layers.L.enorm.weight``, ``.hnorm.weight``,
``.eh_proj.weight``, ``.shared_head.norm.weight``, the block's usual names
(``.self_attn.q_proj.weight``, ``.mlp.gate_proj.weight``, ``.input_layernorm.weight``,
...), and optionally ``.embed_tokens.weight`` and ``.shared_head.head.weight``.
"""

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from shared.model.attention import plan_attention
from shared.model.forward_batch import AttentionMetadata
from shared.model.layers import Linear, MergedLinear, RMSNorm
from shared.model.loader import INDEX_FILE, SINGLE_FILE
from shared.model.models.llama import DecoderLayer, LlamaForCausalLM
from shared.model.ops import Ops, kernel_ops

LLAMA_FAMILY = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
SHARED_NAMES = ("embed_tokens.weight", "shared_head.head.weight")
"""Copies of the target's embedding and LM head that DeepSeek's checkpoints carry."""


class SharedHead(nn.Module):
    """DeepSeek's ``shared_head``: its own norm before the target's LM head."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device, ops: Ops) -> None:
        super().__init__()
        self.norm = RMSNorm(size, eps, dtype, device, ops)


class MtpLayer(nn.Module):
    """The MTP layer over a target (not a submodule: its embedding and head are shared, not copied)."""

    def __init__(self, target: LlamaForCausalLM) -> None:
        super().__init__()
        config = target.config
        if config.architecture not in LLAMA_FAMILY or type(target) is not LlamaForCausalLM:
            raise ValueError(
                f"an MTP head is implemented for the Llama family ({', '.join(LLAMA_FAMILY)}), "
                f"not {config.architecture}: use speculative='draft' or 'ngram'"
            )
        param = target.model.embed_tokens.weight
        # The target's kernels, plain (a batch-invariant target's table is not the MTP layer's).
        dtype, device, ops = param.dtype, param.device, kernel_ops(target.use_triton)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.target = (target,)  # a tuple: nn.Module would register it as a submodule
        self.layer_index = config.num_hidden_layers
        self.enorm = RMSNorm(hidden, eps, dtype, device, ops)
        self.hnorm = RMSNorm(hidden, eps, dtype, device, ops)
        self.eh_proj = Linear(2 * hidden, hidden, False, dtype, device, ops)
        # The block attends over all its keys (a sliding target's MTP still gets layer 0's config).
        block_config = dataclasses.replace(config, num_hidden_layers=1, sliding_windows=(None,))
        self.block = DecoderLayer(block_config, 0, dtype, device, ops)
        self.shared_head = SharedHead(hidden, eps, dtype, device, ops)
        self._triton_attention = ops.attention
        self._windows = frozenset([None])

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden [T, H]: the target's final hidden state at each row's position (or the
        layer's own output, chaining); input_ids [T]: the token after that position;
        positions [T]: rope positions. Returns the layer's output o [T, H] (before
        ``shared_head.norm``), which is also what a further application chains on."""
        target = self.target[0]
        embedded = target.model.embed_tokens(input_ids)
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden.to(embedded.dtype))], dim=-1))
        cos, sin = target.rotary_emb(positions, x.dtype)
        if self._triton_attention is not None:
            c = target.config
            plan = self._triton_attention.plan_triton_attention(meta, c.num_key_value_heads, c.head_dim, x.device)
        else:
            plan = plan_attention(meta, self._windows, x.device)
        out, residual = self.block(x, None, cos, sin, kv_cache, meta, plan)
        return out + residual

    @torch.inference_mode()
    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        """float32 logits of the token two after each row's hidden state."""
        return self.target[0].compute_logits(self.shared_head.norm(out))

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """The block's cache [2, num_blocks, block_size, kv_heads, head_dim], zeroed (see CausalLM)."""
        c = self.target[0].config
        device = self.eh_proj.weight.device
        return torch.zeros(2, num_blocks, block_size, c.num_key_value_heads, c.head_dim, dtype=dtype, device=device)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Each checkpoint name of the layer -> the tensor to copy it into (q/k/v and
        gate/up into their rows of the stacked projections, as CausalLM does)."""
        prefix = f"model.layers.{self.layer_index}."
        merged = {name: m for name, m in self.named_modules() if isinstance(m, MergedLinear)}
        targets: dict[str, torch.Tensor] = {}
        for name, param in self.named_parameters():
            module_name = name.rpartition(".")[0]
            if module_name not in merged:
                targets[prefix + name.removeprefix("block.")] = param.detach()
        for module_name, module in merged.items():
            parent = module_name.rpartition(".")[0].removeprefix("block.")
            targets.update({f"{prefix}{parent}.{part}": view for part, view in module.shard_views().items()})
        return targets


def num_mtp_layers(folder: str | Path) -> int:
    """config.json's ``num_nextn_predict_layers`` (0 when absent)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return int(config.get("num_nextn_predict_layers") or 0)


@torch.no_grad()
def load_mtp(folder: str | Path, target: LlamaForCausalLM) -> MtpLayer:
    """The first MTP layer of the checkpoint in ``folder`` over ``target`` (loaded from it).
    ValueError when the checkpoint carries none or carries it incompletely."""
    folder = Path(folder)
    layer = MtpLayer(target)
    files = _tensor_files(folder)
    names = layer.checkpoint_tensors()
    if num_mtp_layers(folder) < 1 or not any(name in files for name in names):
        raise ValueError(
            f"{folder} carries no MTP layer (config.json num_nextn_predict_layers >= 1 and "
            f"model.layers.{layer.layer_index}.eh_proj.weight ...): use speculative='draft' or 'ngram', "
            "or train one (python -m tools.train.mtp_head)"
        )
    missing = sorted(set(names) - set(files))
    if missing:
        raise ValueError(f"{folder}: the MTP layer lacks {', '.join(missing[:8])}")
    shared = {f"model.layers.{layer.layer_index}.{name}": tensor for name, tensor in _shared_tensors(target).items()}
    for file in sorted({files[n] for n in [*names, *shared] if n in files}):
        with safe_open(str(folder / file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in names:
                    if tuple(f.get_slice(name).get_shape()) != tuple(names[name].shape):
                        raise ValueError(f"{folder / file}: {name} has shape {f.get_slice(name).get_shape()}, "
                                         f"expected {tuple(names[name].shape)}")  # fmt: skip
                    names[name].copy_(f.get_tensor(name))
                elif name in shared and not torch.equal(f.get_tensor(name).to(shared[name]), shared[name]):
                    raise ValueError(f"{folder / file}: {name} differs from the target's: only a shared "
                                     "embedding and LM head are supported")  # fmt: skip
    return layer.eval()


def save_mtp(folder: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write an MTP layer's tensors (checkpoint names, ``MtpLayer.checkpoint_tensors``)
    into the single-file checkpoint in ``folder`` beside the model's, and set
    ``num_nextn_predict_layers: 1`` in its config.json. transformers' Llama loads such a
    checkpoint and ignores the extra tensors, as it does DeepSeek-V3's."""
    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        raise ValueError(f"{folder} is sharded: save_mtp writes single-file checkpoints only")
    with safe_open(str(folder / SINGLE_FILE), framework="pt", device="cpu") as f:
        weights = {name: f.get_tensor(name) for name in f.keys()}
        metadata = f.metadata()
    weights.update({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()})
    save_file(weights, str(folder / SINGLE_FILE), metadata=metadata or {"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _shared_tensors(target: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    embed = target.model.embed_tokens.weight
    head = embed if target.lm_head is None else target.lm_head.weight
    return dict(zip(SHARED_NAMES, (embed, head)))


def _tensor_files(folder: Path) -> dict[str, str]:
    """Tensor name -> file, from the index or the single file (the loader checked them)."""
    if (folder / INDEX_FILE).is_file():
        return dict(json.loads((folder / INDEX_FILE).read_text())["weight_map"])
    with safe_open(str(folder / SINGLE_FILE), framework="pt", device="cpu") as f:
        return {name: SINGLE_FILE for name in f.keys()}
