"""A vision-language checkpoint's vision tower alone: what a vision instance
(services/vision) runs. It encodes images and nothing else, so it builds the family's
tower (``build_tower``) without the language model and reads only the tower's tensors
(``visual.*``, as the family's checkpoints name them) from the memory-mapped
safetensors: the language model's weights, most of a checkpoint, are never read nor
held. Its images' rows are the whole model's (the same tower, the same weights:
``encode_images`` is the model's ``encode_with``)."""

from pathlib import Path

import torch
from torch import nn

from shared.model.checkpoint_files import CheckpointError, CheckpointReader, logical_tensors, quant_scheme, tensor_files
from shared.model.config import ModelConfig
from shared.model.loader import model_sources, read_config
from shared.model.models import model_class
from shared.model.models.llama import checkpoint_targets
from shared.model.models.qwen_vl_base import QwenVLForConditionalGeneration, encode_with
from shared.model.multimodal import ImageInputs

_TOWER = "visual."
"""The tower's module name in the whole model (our names; checkpoint_name spells them as released)."""


class NoVisionTower(ValueError):
    """The checkpoint's model has no vision tower (a text-only model), or one of a family
    this loader does not know."""


class VisionTower(nn.Module):
    """The tower of ``config``'s model, as a vision instance holds it: ``config`` (its
    ``vision_language``) and ``encode_images``, as the whole model has them."""

    def __init__(self, config: ModelConfig, visual: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.visual = visual

    def encode_images(self, images: ImageInputs) -> list[torch.Tensor]:
        return encode_with(self.visual, images)


def load_vision_tower(path: str | Path, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> VisionTower:  # fmt: skip
    """The checkpoint folder's vision tower, its tensors read and nothing else.
    NoVisionTower for a model without one; a CheckpointError naming what the checkpoint
    lacks or holds in another shape."""
    folder = Path(path)
    config = read_config(folder)
    cls = model_class(config)
    vl = config.vision_language
    if vl is None or not issubclass(cls, QwenVLForConditionalGeneration):
        raise NoVisionTower(f"{folder}: {config.architecture} has no vision tower to load alone")
    visual = cls.build_tower(config, vl, dtype, torch.device(device))
    scheme = quant_scheme(folder)
    sources = model_sources(folder, config, logical_tensors(tensor_files(folder), scheme, folder))
    targets = {cls.checkpoint_name(_TOWER + name): t for name, t in checkpoint_targets(visual, set(sources)).items()}
    missing = sorted(set(targets) - set(sources))
    if missing:
        raise CheckpointError(f"{folder}: the vision tower's tensors {missing[:8]} are not in the checkpoint")
    with CheckpointReader(folder, scheme) as reader, torch.no_grad():
        for name in sorted(targets, key=lambda n: (sources[n].file, sources[n].data)):
            source, target = sources[name], targets[name]
            shape = reader.shape(source)
            if shape != tuple(target.shape):
                raise CheckpointError(f"{folder / source.file}: tensor {source.data} has shape {shape}, expected "
                                      f"{tuple(target.shape)} from config.json")  # fmt: skip
            target.copy_(reader.read(source))
    return VisionTower(config, visual).eval()
