"""The model's image processor, where the engine runs: decoded pixels (uint8, height
x width x 3, as the balancer sends them) to ``ImageInputs``. It is transformers' own
(the checkpoint's preprocessor_config.json through AutoImageProcessor: the PIL
backend where torchvision is absent), so resizing and normalising are exactly what
transformers does. Importing it takes seconds cold, so it loads here, beside the
engine, and never in the torch-free balancer."""

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shared.model.multimodal import ImageInputs


class ImageProcessor:
    def __init__(self, model_dir: str | Path) -> None:
        import transformers

        self._processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir))

    def __call__(self, images: Sequence[np.ndarray]) -> ImageInputs:
        """The images' patches and grids, in order (one call: the processor batches them)."""
        from PIL import Image

        pil = [Image.fromarray(np.asarray(pixels, dtype=np.uint8), "RGB") for pixels in images]
        out = self._processor(images=pil, return_tensors="pt")
        return ImageInputs.from_processor(out["pixel_values"], out["image_grid_thw"])
