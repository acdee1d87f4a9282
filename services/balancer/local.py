"""A Generator over an in-process engine: the balancer serving alone on one
machine, and the way to test the HTTP layer against a real engine.

The engine runs without detokenization: text and stop strings are the HTTP
layer's job, exactly as with the mesh, so both generators behave the same.
The engine (and with it torch) is imported when one starts, not with this
module: the balancer's package imports without torch.
"""

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

from services.balancer.generation import GenerationError, GenerationRequest, TokenEvent, Usage
from shared.engine.config import EngineConfig
from shared.engine.sampling_params import InvalidParam

if TYPE_CHECKING:
    from shared.engine.async_engine import AsyncEngine
    from shared.engine.engine_request import RequestImages
    from shared.model.vision.processor import ImageProcessor


class LocalGenerator:
    def __init__(self, engine: "AsyncEngine", processor: "ImageProcessor | None" = None) -> None:
        """engine must run an LLMEngine built with detokenize=False (see `start`);
        processor: the model's image processor, for a model that takes images."""
        if engine.engine.detokenize:
            raise ValueError("LocalGenerator needs an engine built with detokenize=False: text is the HTTP layer's job")
        self.engine = engine
        self.processor = processor

    @classmethod
    def start(cls, config: EngineConfig, loop: asyncio.AbstractEventLoop | None = None) -> "LocalGenerator":
        """Load the model (blocking: seconds) and start the engine thread, which
        hands outputs to loop (default: the running loop)."""
        from shared.engine.async_engine import AsyncEngine
        from shared.engine.llm_engine import LLMEngine

        engine = LLMEngine(config, detokenize=False)
        processor = None
        if engine.model.config.vision_language is not None:
            from shared.model.vision.processor import ImageProcessor

            processor = ImageProcessor(config.model)
        async_engine = AsyncEngine(engine, loop or asyncio.get_running_loop())
        async_engine.start()
        return cls(async_engine, processor)

    async def shutdown(self) -> None:
        await self.engine.shutdown()

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def num_in_flight(self) -> int:
        return self.engine.num_in_flight

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        from shared.engine.async_engine import EngineDead  # loaded already: this instance runs an engine

        from shared.engine.engine_request import EngineRequest

        images = await self._process_images(request)
        outputs = self.engine.generate(EngineRequest(
            request.request_id, request.prompt_token_ids, request.params, request.cache_salt, images=images,
        ))  # fmt: skip
        # aclosing: when our caller stops early, AsyncEngine.generate's finally aborts the request.
        async with aclosing(outputs):
            try:
                async for out in outputs:
                    # Every event carries usage so far: a stop string may end the stream early.
                    usage = Usage(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens,
                                  out.num_spec_drafted_tokens, out.num_spec_accepted_tokens)  # fmt: skip
                    yield TokenEvent(out.new_token_ids, out.new_logprobs, out.finish_reason, usage, out.prompt_logprobs)
            except EngineDead as exc:
                raise GenerationError(f"the engine is not running: {exc}", 503, "service_unavailable") from exc
            except InvalidParam as exc:  # the engine refused one of the request's parameters
                raise GenerationError(exc.message, 400, "invalid_request_error", param=exc.param) from exc
            except ValueError as exc:  # the engine refused the request (add_request's other checks)
                raise GenerationError(str(exc), 400, "invalid_request_error") from exc

    async def _process_images(self, request: GenerationRequest) -> "RequestImages | None":
        """The request's decoded images through the model's image processor, on a worker
        thread (resizing and normalising take milliseconds an image), named as the front
        door named them."""
        if not request.images:
            return None
        if self.processor is None:  # the front door lets images through only for a model that takes them
            raise GenerationError("images reached a model without an image processor", 400, "invalid_request_error",
                                  param="messages")  # fmt: skip
        from shared.engine.engine_request import RequestImages

        inputs = await asyncio.to_thread(self.processor, [image.pixels for image in request.images])
        return RequestImages(inputs, tuple(image.hash for image in request.images))
