"""Which quantised checkpoint tensors stay quantised in memory, and the modules that hold them.

``EngineConfig.quantized_weights`` says "dequantize" (every quantised tensor becomes the
model dtype while loading: shared/model/checkpoint_files.py) or "keep". ``kept_formats``
turns it and the device into what is actually kept:

- FP8 block-scaled linears (e4m3 + 128 x 128 scales) on CUDA of capability >= 8.9
  (Ada, Hopper: the first with FP8 tensor cores, which the Triton FP8 dot needs);
- MXFP4 experts (GPT-OSS) on CUDA, any capability (decoded in registers to the
  activations' dtype: shared/model/kernels/fused_moe_mxfp4.py);
- nothing elsewhere: the CPU dequantises as it always did.

``keep_quantized`` then rebuilds, before any weight is read, the modules whose tensors
stay quantised: a plain ``Linear`` whose checkpoint weight is e4m3 becomes an
``Fp8Linear``; GPT-OSS ``Experts`` whose fused tensors are MXFP4 hold them packed
(``Experts.keep_mxfp4``). It returns each such checkpoint name with the tensors the
loader copies the stored data and scale into, unconverted. Other quantised tensors
(FP8 rows of a merged projection, FP8 or FP4 per-expert tensors of stacked experts, a
linear the model reads as a plain weight) are dequantised as before.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from shared.model.checkpoint_files import TensorSource
from shared.model.fp8_linear import Fp8Linear
from shared.model.layers import Linear
from shared.model.moe import Experts
from shared.model.ops import Ops

QUANTIZED_WEIGHTS_CHOICES: tuple[str, ...] = ("dequantize", "keep")
"""The values of ``EngineConfig.quantized_weights`` (the engine keeps the same tuple, torch-free)."""
FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True, slots=True)
class KeptFormats:
    """The quantised forms the loader keeps as stored; False: dequantised to the model dtype."""

    fp8: bool = False
    mxfp4: bool = False

    @property
    def any(self) -> bool:
        return self.fp8 or self.mxfp4


@dataclass(frozen=True, slots=True)
class KeptTarget:
    """Where one kept checkpoint tensor goes: its stored data and its scales, as stored."""

    data: torch.Tensor
    scale: torch.Tensor


def kept_formats(mode: str, device: torch.device | str) -> KeptFormats:
    """What ``mode`` ("dequantize" or "keep") keeps on ``device``."""
    if mode not in QUANTIZED_WEIGHTS_CHOICES:
        raise ValueError(f"quantized_weights must be one of {QUANTIZED_WEIGHTS_CHOICES}, got {mode!r}")
    device = torch.device(device)
    if mode == "dequantize" or device.type != "cuda":
        return KeptFormats()
    return KeptFormats(fp8=torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY, mxfp4=True)


def keep_quantized(
    model: torch.nn.Module,
    sources: Mapping[str, TensorSource],
    stored_dtype: Callable[[TensorSource], str],
    formats: KeptFormats,
    block: tuple[int, int] | None,
    ops: Ops,
) -> dict[str, KeptTarget]:
    """Rebuild ``model``'s modules whose checkpoint tensors stay quantised (see above);
    checkpoint name -> the tensors its data and scale are copied into. ``sources``: the
    model's names -> where they are stored; ``stored_dtype``: a source's safetensors dtype
    ("F8_E4M3"...); ``block``: the fp8 scheme's tile; ``ops``: the model's kernel table."""
    kept: dict[str, KeptTarget] = {}
    # (storage address, shape) -> checkpoint name, read once: a module whose weight is a
    # checkpoint tensor whole is found by its address, and no tensor is held meanwhile
    # (each float weight is freed as its module is replaced).
    names = {(t.data_ptr(), tuple(t.shape)): name for name, t in model.checkpoint_tensors(set(sources)).items()}
    if formats.fp8 and block is not None:
        for parent_name, parent in list(model.named_modules()):
            for child_name, child in list(parent.named_children()):
                # type(), not isinstance: a MergedLinear's rows are several checkpoint tensors.
                if type(child) is not Linear or child.bias is not None or not child.fp8_keepable:
                    continue
                if child is getattr(model, "lm_head", None):
                    continue  # the logits read its weight directly (CausalLM.compute_logits)
                name = names.get((child.weight.data_ptr(), tuple(child.weight.shape)))
                if name is None or sources[name].scale is None or stored_dtype(sources[name]) != "F8_E4M3":
                    continue
                out_features, in_features = child.weight.shape
                fp8 = Fp8Linear(in_features, out_features, block, child.weight.device, ops.fp8_linear)
                setattr(parent, child_name, fp8)
                kept[name] = KeptTarget(fp8.weight.detach(), fp8.weight_scale)
    if formats.mxfp4:
        packed = [m for m in model.modules() if isinstance(m, Experts) and _all_fp4(m, names, sources, stored_dtype)]
        for module in packed:
            module.keep_mxfp4(ops.fused_moe_mxfp4)
        if packed:
            # The packed targets (fused or per-expert views), found again under the model's
            # names, each with the rows of the scales that go with it.
            for name, t in model.checkpoint_tensors(set(sources)).items():
                scales = next((s for m in packed if (s := m.packed_scales_of(t)) is not None), None)
                if scales is not None:
                    kept[name] = KeptTarget(t, scales)
    return kept


def _all_fp4(
    module: Experts,
    names: Mapping[tuple[int, tuple[int, ...]], str],
    sources: Mapping[str, TensorSource],
    stored_dtype: Callable[[TensorSource], str],
) -> bool:
    """Whether every checkpoint tensor of these experts' weights (found by address within
    the stacked tensors) is e2m1 in groups of 32 with E8M0 scales: GPT-OSS's MXFP4 pair or
    DeepSeek-V4's int8 FP4 experts. Half kept, half not, would need both layouts: refused."""
    spans = [(w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()) for w in (module.gate_up_proj, module.down_proj)]
    inside = [name for (ptr, _), name in names.items() if any(lo <= ptr < hi for lo, hi in spans)]
    if not inside:
        return False
    for name in inside:
        source = sources.get(name)
        if source is None or source.scale is None:
            return False
        if not source.mxfp4 and stored_dtype(source) not in ("I8", "U8"):
            return False
    return True
