"""DeepSeek-V4's multi-token-prediction (MTP) module, as DeepSeek's inference code
defines its ``MTPBlock`` (a V4 ``Block`` plus its own projections and hyper head), over
a ``DeepseekV4ForCausalLM`` target whose embedding and LM head it shares.

At position i it reads the target's residual streams h_i [hc, hidden] *before* the
hyper head (not the collapsed, normed state a V3-style MTP reads) and the embedding of
t_{i+1}, and predicts t_{i+2}:

    x   = e_proj(enorm(embed(t_{i+1})))[None] + h_proj(hnorm(h_i))   # [hc, hidden]: one
          embedding projection added to every stream, each stream normed and projected
    o_i = block(x)                # a V4 decoder layer on the streams (mHC, attention, MoE)
    p(t_{i+2}) = softmax(head(norm(hc_head(o_i))))   # its own hyper head and norm

o_i (the streams, not the collapsed state) stands in for the target's h_{i+1} when the
module is applied again for a further token, as vLLM's V4 MTP chains it. The streams
travel flattened, [T, hc * hidden], so the drafter handles them as any hidden state.

The block is what V4's releases make it: sliding-window attention only (V4-Flash's
``compress_ratios`` has one entry past the last layer, 0, for the MTP layer) and a
learned router (its index, ``num_hidden_layers``, is past the hash-routed layers).
It keeps its own window KV in a state cache of [2, blocks, block_size, 1, head_dim].

Checkpoint names are DeepSeek's, ``mtp.0.*`` (``model.mtp.0.*`` accepted):
``enorm.weight``, ``hnorm.weight``, ``e_proj.weight``, ``h_proj.weight``,
``norm.weight``, ``hc_head_{fn,base,scale}``, and the block's as a layer's
(``attn.wq_a.weight``, ``attn.kv_norm.weight``, ``attn_sink``, ``ffn.gate.bias``,
``ffn.experts.E.w1.weight``, ``hc_attn_fn``...). FP8/FP4 pairs are dequantised by the
checkpoint reader as for the model. Loading sets ``keep_streams`` on the target: the
module reads the streams its forward would otherwise drop.
"""

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from shared.model.checkpoint_files import CheckpointError, CheckpointReader, logical_tensors, quant_scheme, tensor_files
from shared.model.forward_batch import AttentionMetadata
from shared.model.hyper_connections import HyperHead
from shared.model.layers import Linear
from shared.model.models.deepseek_v4 import (
    DeepseekV4ForCausalLM, V4DecoderLayer, V4RMSNorm, module_targets, saved_name,
)  # fmt: skip
from shared.model.models.deepseek_v4_config import SLIDING

MTP_PREFIXES = ("mtp.0.", "model.mtp.0.")
"""The first MTP layer's names, in DeepSeek's spelling and with transformers' prefix."""
SHARED_COPIES = ("emb.tok_emb.weight", "embed.weight", "head.weight")
"""Copies of the target's embedding and head some exports put in the MTP layer: checked equal, not loaded."""
_BLOCK = "model.layers.0."


class V4MtpLayer(nn.Module):
    """V4's MTP module over its target (held in a tuple: not a submodule)."""

    def __init__(self, target: DeepseekV4ForCausalLM) -> None:
        super().__init__()
        config, p = target.config, target.config.deepseek_v4
        assert p is not None
        param = target.model.embed_tokens.weight
        dtype, device = param.dtype, param.device
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.target = (target,)
        self.hc_mult = p.hc_mult
        self.enorm = V4RMSNorm(hidden, eps, device)
        self.hnorm = V4RMSNorm(hidden, eps, device)
        self.e_proj = Linear(hidden, hidden, False, dtype, device)
        self.h_proj = Linear(hidden, hidden, False, dtype, device)
        # One sliding-window layer with a learned router (see the module docstring).
        v4 = dataclasses.replace(p, layer_types=(SLIDING,), compress_rates=(0,))
        block_config = dataclasses.replace(config, num_hidden_layers=1, deepseek_v4=v4, mlp_layer_types=("moe",))
        self.block = V4DecoderLayer(block_config, 0, dtype, device)
        self.norm = V4RMSNorm(hidden, eps, device)
        self.hc_head = HyperHead(hidden, p.hc_mult, p.hc_eps, eps, device)
        self.head_dim = config.head_dim

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden [T, hc * H]: the target's streams at each row's position (or this
        module's output, chaining); input_ids [T]: the token after that position;
        positions [T]: the rows' positions (rope; the window is counted in meta's
        positions). Returns the block's output streams, flattened [T, hc * H]."""
        target = self.target[0]
        embedded = self.enorm(target.model.embed_tokens(input_ids))
        streams = self.hnorm(hidden.view(hidden.shape[0], self.hc_mult, -1).to(embedded.dtype))
        x = self.e_proj(embedded).unsqueeze(1) + self.h_proj(streams)
        rope = target.main_rotary(positions, x.dtype)  # a sliding layer rotates by the main rope
        out = self.block(x, input_ids, positions, rope, rope, target.compress_rotary, kv_cache, None, meta, None)
        return out.flatten(1)

    @torch.inference_mode()
    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        """float32 logits of the token two after each row's position, through this
        module's hyper head and norm and the target's LM head."""
        streams = out.view(out.shape[0], self.hc_mult, -1)
        return self.target[0].compute_logits(self.norm(self.hc_head(streams)))

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """The block's state cache [1, num_blocks, block_size, 1, head_dim], zeroed: a
        sliding layer's row is its K = V entry alone (no plane 1, as in the model's)."""
        device = self.e_proj.weight.device
        return torch.zeros(1, num_blocks, block_size, 1, self.head_dim, dtype=dtype, device=device)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """DeepSeek's checkpoint name (``mtp.0.*``) -> the tensor to copy it into."""
        targets = {
            "mtp.0.enorm.weight": self.enorm.weight, "mtp.0.hnorm.weight": self.hnorm.weight,
            "mtp.0.e_proj.weight": self.e_proj.weight, "mtp.0.h_proj.weight": self.h_proj.weight,
            "mtp.0.norm.weight": self.norm.weight, "mtp.0.hc_head_fn": self.hc_head.hc_fn,
            "mtp.0.hc_head_base": self.hc_head.hc_base, "mtp.0.hc_head_scale": self.hc_head.hc_scale,
        }  # fmt: skip
        for name, tensor in module_targets(self.block, None).items():
            # The names a layer is saved under (transformers'), then DeepSeek's spelling of them.
            rest = saved_name(_BLOCK + name).removeprefix(_BLOCK).replace("attn.norm.", "attn.kv_norm.")
            targets["mtp.0." + rest] = tensor
        return {name: t.detach() for name, t in targets.items()}


def mtp_layer_kind(config: dict[str, object]) -> int:
    """The MTP layer's compression rate from config.json: ``compress_ratios``' entry past
    the last layer where the release lists one (V4-Flash: 0), else 0 as V4 ships it."""
    ratios = config.get("compress_ratios")
    num_layers = int(config["num_hidden_layers"])  # type: ignore[arg-type]
    if isinstance(ratios, list) and len(ratios) > num_layers:
        return int(ratios[num_layers])
    return 0


@torch.no_grad()
def load_v4_mtp(folder: str | Path, target: DeepseekV4ForCausalLM) -> V4MtpLayer:
    """The first MTP layer of the V4 checkpoint in ``folder`` over ``target`` (loaded
    from it). ValueError when it carries none; CheckpointError naming the tensor when one
    is missing, misshapen, unknown, or a shared copy that differs from the target's."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    scheme = quant_scheme(folder)
    sources = logical_tensors(tensor_files(folder), scheme, folder)
    stored = {_strip(name): source for name, source in sources.items() if name.startswith(MTP_PREFIXES)}
    if int(config.get("num_nextn_predict_layers") or 0) < 1 or not stored:
        raise ValueError(
            f"{folder} carries no MTP layer (config.json num_nextn_predict_layers >= 1 and mtp.0.* tensors): "
            "use speculative='draft' or 'ngram'"
        )
    rate = mtp_layer_kind(config)
    if rate:
        raise CheckpointError(f"{folder}: the MTP layer has compressed attention (compress_ratios[-1] = {rate}); "
                              "only V4's sliding-window MTP layer is implemented")  # fmt: skip
    layer = V4MtpLayer(target)
    names = layer.checkpoint_tensors()
    missing = sorted(set(names) - set(stored))
    if missing:
        raise CheckpointError(f"{folder}: the MTP layer lacks {', '.join(missing[:8])}{', ...' if len(missing) > 8 else ''}")
    shared = {f"mtp.0.{n}" for n in SHARED_COPIES} & set(stored)
    unknown = sorted(set(stored) - set(names) - shared)
    if unknown:
        raise CheckpointError(f"{folder}: MTP tensors the module does not use: {', '.join(unknown[:8])}")
    with CheckpointReader(folder, scheme) as reader:
        for name, param in names.items():
            source = stored[name]
            shape = reader.shape(source)
            if shape != tuple(param.shape):
                raise CheckpointError(f"{folder / source.file}: {source.data} has shape {shape}, expected {tuple(param.shape)}")
            param.copy_(reader.read(source))
        for name in sorted(shared):
            head = target.model.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
            own = target.model.embed_tokens.weight if "emb" in name else head
            if not torch.equal(reader.read(stored[name]).to(own), own):
                raise CheckpointError(f"{folder}: {stored[name].data} differs from the target's: only a shared "
                                      "embedding and LM head are supported")  # fmt: skip
    target.keep_streams = True
    return layer.eval()


def _strip(name: str) -> str:
    """``model.mtp.0.x`` -> ``mtp.0.x``."""
    return name.removeprefix("model.")
