"""A chat request's images: found in its messages, refused where the model takes
none, loaded (shared/multimodal/) where it does, each one's placeholder in the
tokenised prompt expanded to its number of tokens, and every image's fault turned
into an OpenAI 400 naming the content part (messages.<i>.content.<j>) and saying why."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.balancer.frontend import protocol as p
from services.balancer.frontend.errors import APIError
from shared.multimodal.errors import ImageError
from shared.multimodal.grid import PatchGrid
from shared.multimodal.image import ImageRef, LoadedImage
from shared.multimodal.loader import ImageLoader
from shared.runtime.settings import ImageSettings


@dataclass(frozen=True, slots=True)
class ModelImages:
    """What the served model makes of images."""

    accepts: bool = False
    """Its architecture is a vision-language one (ArchTraits.accepts_images)."""
    processor_settings: Mapping[str, Any] = field(default_factory=dict)
    """Its image processor's settings (preprocessor_config.json): part of every image's
    hash, and what decides how many tokens an image takes (PatchGrid)."""
    image_token_id: int | None = None
    """The placeholder the chat template writes once per image and the prompt repeats
    once per image token (config.json's image_token_id); needed where ``accepts``."""

    def __post_init__(self) -> None:
        if self.accepts and self.image_token_id is None:
            raise ValueError("a model that accepts images needs its image_token_id")


class ImageIntake:
    """The front door's images: the model's stance on them and a loader for its requests'."""

    def __init__(self, settings: ImageSettings, model_name: str, model: ModelImages) -> None:
        self.model_name = model_name
        self.model = model
        self.loader = ImageLoader(settings, model_name, model.processor_settings)
        self.grid = PatchGrid.from_settings(model.processor_settings)

    def refs(self, body: p.ChatCompletionRequest | p.TokenizeChatRequest) -> list[ImageRef]:
        """The request's images, in order; a 400 when the model takes none or there are too many.
        Nothing is fetched or decoded here: a refused request costs no download."""
        refs = [
            _ref(part, f"messages.{i}.content.{j}")
            for i, message in enumerate(body.messages)
            for j, part in message.image_parts
        ]
        if refs and not self.model.accepts:
            where = refs[0].param
            raise APIError(400, f"{where}: the model `{self.model_name}` does not accept images (a text-only "
                           "model); send text content only", param=where, code="image_input_not_supported")
        try:
            self.loader.check_count(refs)
        except ImageError as exc:
            raise _refused(exc) from None
        return refs

    async def load(self, refs: list[ImageRef]) -> list[LoadedImage]:
        """Every image of the request, loaded concurrently; the first bad one is a 400."""
        try:
            return await self.loader.load(refs)
        except ImageError as exc:
            raise _refused(exc) from None


    def expand(self, prompt_ids: list[int], refs: list[ImageRef], images: list[LoadedImage]) -> list[int]:
        """The prompt with each image's one placeholder (as the chat template wrote it)
        repeated once per token the image takes: its patches after the processor's
        resize, over merge x merge. A 400 where the placeholders and images disagree
        (a template that dropped an image, or placeholder text in a message)."""
        token = self.model.image_token_id
        if not images or token is None:
            return prompt_ids
        found = prompt_ids.count(token)
        if found != len(images):
            raise APIError(400, f"messages: the conversation renders {found} image placeholder(s) for "
                           f"{len(images)} image(s): each image part must give one, and text may not spell one",
                           param="messages")  # fmt: skip
        counts = iter(self._tokens(refs, images))
        out: list[int] = []
        for t in prompt_ids:
            out += [token] * next(counts) if t == token else [t]
        return out

    def _tokens(self, refs: list[ImageRef], images: list[LoadedImage]) -> list[int]:
        try:
            return [self.grid.num_tokens(*image.size, ref.param) for ref, image in zip(refs, images)]
        except ImageError as exc:
            raise _refused(exc) from None


def _ref(part: p.ImagePart, param: str) -> ImageRef:
    assert part.image_url is not None  # ImagePart refuses a part without one
    return ImageRef(part.image_url.url, param, part.image_url.detail, part.uuid)


def _refused(exc: ImageError) -> APIError:
    return APIError(400, str(exc), param=exc.param, code=exc.code)
