"""DeepSeek-V4's checkpoint spellings, mapped onto the names ``DeepseekV4ForCausalLM.
checkpoint_tensors`` knows (those transformers saves: ``deepseek_v4.saved_name``).

DeepSeek releases V4 (and V4-Flash) in the names of its own inference code, which
transformers' conversion mapping renames on load: no ``model.`` prefix, ``embed`` for
the embeddings, the hyper head as three loose tensors, and the attention's KV norm as
``kv_norm`` where transformers saves ``norm``::

    embed.weight                    -> model.embed_tokens.weight
    norm.weight                     -> model.norm.weight
    head.weight                     -> head.weight
    hc_head_{fn,base,scale}         -> model.hc_head.hc_{fn,base,scale}
    layers.N.attn.kv_norm.weight    -> model.layers.N.attn.norm.weight
    layers.N.<rest>                 -> model.layers.N.<rest>   (attn.wq_a, ffn.experts.E.w1, hc_attn_fn...)
    mtp.K.*                         -> set aside: the MTP module's (models/deepseek_v4_mtp.py loads them)

The layouts agree: ``attn.wo_a`` ships flattened, [o_groups * o_lora_rank, heads *
head_dim / o_groups], which is the grouped projection's weight as this model keeps it
(transformers' in-memory 3-D grouped tensor is the same bytes); the routed experts
ship one tensor per expert and projection, as transformers saves them. Quantised
weights (``X.weight`` + ``X.scale``) have been folded into ``X.weight`` before this
map sees the names (shared/model/checkpoint_files.py).
"""

import re
from collections.abc import Collection, Mapping

_MTP = re.compile(r"(^|\.)mtp\.")
_TOP_LEVEL: Mapping[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "head.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


def is_deepseek_spelling(names: Collection[str]) -> bool:
    """DeepSeek's own names (no ``model.`` prefix) rather than transformers'."""
    return "embed.weight" in names or any(name.startswith("layers.") for name in names)


def deepseek_name(name: str) -> str:
    """The name transformers saves a tensor under, from DeepSeek's name for it."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    if name.startswith("layers."):
        return "model." + name.replace(".attn.kv_norm.", ".attn.norm.")
    return name  # not a V4 name: the loader reports it as unexpected


def v4_checkpoint_names(names: Collection[str]) -> Mapping[str, str | None]:
    """``ModelEntry.checkpoint_names`` for V4: either spelling; the ``mtp.*`` tensors (the
    MTP module's, in either spelling) set aside."""
    rename = deepseek_name if is_deepseek_spelling(names) else (lambda name: name)
    return {name: None if _MTP.search(name) else rename(name) for name in names}
