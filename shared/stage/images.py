"""A mesh request's images where an engine stage runs them (prefill, and decode, which
re-encodes what it must recompute): the wire's lossless PNGs decoded and run through
the model's image processor off the event loop, named by the identities the balancer
sent, as the RequestImages an EngineRequest takes. The engine then runs the vision
tower on a worker thread of its own (AsyncEngine), also off the step loop."""

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from opentelemetry.trace import Tracer

from shared.engine.engine_request import RequestImages
from shared.engine.sampling_params import InvalidParam
from shared.proto import mesh_pb2
from shared.stage.convert import image_from_proto

if TYPE_CHECKING:
    from shared.model.vision.processor import ImageProcessor


class StageImages:
    def __init__(self, processor: "ImageProcessor | None") -> None:
        """processor: the model's image processor; None for a text-only model."""
        self.processor = processor

    @classmethod
    async def load(cls, model_dir: str | Path, vision_language: bool) -> "StageImages":
        """The model's processor for a vision-language model (importing transformers takes
        seconds: on a worker thread), none for another."""
        if not vision_language:
            return cls(None)
        from shared.model.vision.processor import ImageProcessor

        return cls(await asyncio.to_thread(ImageProcessor, model_dir))

    async def request_images(self, messages: Sequence[mesh_pb2.ImageData], tracer: Tracer) -> RequestImages | None:
        """The request's images for its EngineRequest (None without any), under an
        "images" span. InvalidParam("images") where this model takes none or a message
        is not the image it says (the balancer's bug: never encoded as another image)."""
        if not messages:
            return None
        processor = self.processor
        if processor is None:
            raise InvalidParam("images", "are not accepted by this model (a text-only model)")

        def process() -> RequestImages:
            pixels = [image_from_proto(msg, f"images.{k}") for k, msg in enumerate(messages)]
            return RequestImages(processor(pixels), tuple(msg.hash for msg in messages))

        with tracer.start_as_current_span("images") as span:
            span.set_attribute("images.count", len(messages))
            span.set_attribute("images.png_bytes", sum(len(msg.png) for msg in messages))
            try:
                return await asyncio.to_thread(process)
            except ValueError as exc:
                raise InvalidParam("images", f"could not be read: {exc}") from None
