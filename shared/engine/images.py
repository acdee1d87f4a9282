"""A request's images made ready for the engine: checked against its prompt, their
M-RoPE positions computed and the vision tower run over them (``encode``).

The tower runs only for images whose rows this engine is to compute. A request
resumed after a handoff (decode after prefill) brings its prompt's KV: the images
that lie wholly in the blocks it loads need their positions (M-RoPE) and nothing
else, so their tower run waits (``PromptEmbeds``) until a step needs their rows,
which only a failed load or a preemption makes happen. An image that reaches into
the partial last block (which decode recomputes) is encoded at once, as are all of
a request whose prompt this engine computes.

``encode`` reads the model and nothing of the engine's state, so it may run on any
thread: AsyncEngine runs it on a worker thread before the request reaches the step
loop (the tower's forward then overlaps the loop's steps instead of stalling them);
offline, LLMEngine.add_request runs it on the caller's thread.
"""

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.engine_request import RequestImages
from shared.engine.prompt_images import PromptImages
from shared.engine.sampling_params import InvalidParam
from shared.kv.block_hash import image_spans
from shared.model.interface import CausalLM
from shared.model.multimodal import ImageEmbeddings, ImageInputs
from shared.model.vision.mrope import mrope_positions


class PromptEmbeds:
    """A request's image embeddings, image by image, in prompt order: those encoded (or
    fetched from a vision instance) and those whose tower run waits until a step reads
    their rows (``encode_for``). The step loop calls encode_for and rows; an image's
    pixels are kept until then (in host memory: the processor's output), since the
    request's PNGs are gone by that time."""

    __slots__ = ("model", "lengths", "embeds", "pending", "num_encoded")

    def __init__(self, model: CausalLM, lengths: Sequence[int], embeds: list[torch.Tensor | None],
                 pending: list[ImageInputs | None], num_encoded: int) -> None:  # fmt: skip
        self.model = model
        self.lengths = tuple(lengths)
        self.embeds = embeds
        """Per image: its rows [its image tokens, image_embedding_width], or None while pending."""
        self.pending = pending
        """Per image: its pixels while its tower run waits, else None."""
        self.num_encoded = num_encoded
        """Images the tower ran on when the request was admitted (not those fetched)."""

    def _images(self, first: int, count: int) -> list[tuple[int, int]]:
        """(image, its first image token) of the images that image tokens [first, first + count) touch."""
        out, start = [], 0
        for k, length in enumerate(self.lengths):
            if start < first + count and first < start + length:
                out.append((k, start))
            start += length
        return out

    def encode_for(self, first: int, count: int) -> int:
        """Run the tower on the pending images among image tokens [first, first + count);
        how many it ran on."""
        todo = [k for k, _ in self._images(first, count) if self.embeds[k] is None]
        if todo:
            encoded = self.model.encode_images(_subset(self.pending, todo))  # type: ignore[attr-defined]
            for k, e in zip(todo, encoded):
                self.embeds[k], self.pending[k] = e, None
        return len(todo)

    def rows(self, first: int, count: int) -> torch.Tensor:
        """Image tokens [first, first + count)'s rows (encode_for ran for them)."""
        parts = []
        for k, start in self._images(first, count):
            e = self.embeds[k]
            assert e is not None, "encode_for first"
            parts.append(e[max(first - start, 0) : min(first + count - start, self.lengths[k])])
        return torch.cat(parts)


def _subset(pending: Sequence[ImageInputs | None], which: Sequence[int]) -> ImageInputs:
    """The images ``which`` of one-image inputs, as one ImageInputs (one tower call)."""
    picked = [p for p in (pending[k] for k in which) if p is not None]
    assert len(picked) == len(which), "only pending images"
    return ImageInputs(torch.cat([p.pixel_values for p in picked]), tuple(p.grids[0] for p in picked))


def _split(inputs: ImageInputs) -> list[ImageInputs]:
    """Each image of ``inputs`` on its own."""
    sizes = [t * h * w for t, h, w in inputs.grids]
    return [ImageInputs(pixels, (grid,)) for pixels, grid in zip(inputs.pixel_values.split(sizes), inputs.grids)]


@dataclass(frozen=True, slots=True)
class EncodedImages:
    prompt: PromptImages
    embeds: PromptEmbeds
    """Every image's embeddings, in prompt order (some maybe still to encode)."""


def encode(model: CausalLM, prompt_ids: Sequence[int], images: RequestImages, speculative: str,
           num_computed: int = 0) -> EncodedImages:  # fmt: skip
    """The prompt's images, checked and encoded. InvalidParam("images") where the model
    takes none, speculative decoding is on, or the prompt's placeholder runs do not
    match the images (count, or tokens per image: the processor's grid / merge**2).

    ``num_computed``: prompt tokens whose KV the request brings (a handoff's full
    blocks): the images wholly before it are not encoded now (PromptEmbeds)."""
    vl = model.config.vision_language
    if vl is None or not hasattr(model, "encode_images"):
        raise InvalidParam("images", f"are not accepted by {model.config.architecture} (a text-only model)")
    if speculative != "none":
        raise InvalidParam("images", f"are not supported with speculative decoding yet (speculative={speculative!r})")
    check_prompt_tokens(model, prompt_ids, has_images=True)
    try:
        positions = mrope_positions(prompt_ids, images.inputs.grids, vl.image_token_id, vl.vision.spatial_merge_size)
    except ValueError as exc:
        raise InvalidParam("images", f"do not match the prompt's image placeholders: {exc}") from None
    merge = vl.vision.spatial_merge_size
    lengths = [t * (h // merge) * (w // merge) for t, h, w in images.inputs.grids]
    # The runs are where mrope_positions found them (it checked their counts).
    spans = image_spans(prompt_ids, vl.image_token_id, images.hashes, lengths)
    prompt = PromptImages(tuple(spans), positions)
    if isinstance(images.inputs, ImageEmbeddings):  # encoded by a vision instance (E/P/D): no tower here
        fetched: list[torch.Tensor | None] = list(fetched_embeddings(model, images.inputs, lengths))
        return EncodedImages(prompt, PromptEmbeds(model, lengths, fetched, [None] * len(lengths), 0))
    pending: list[ImageInputs | None] = list(_split(images.inputs))
    embeds = PromptEmbeds(model, lengths, [None] * len(lengths), pending, 0)
    # Encoded now: the images that reach past the KV the request brings.
    now = [k for k, span in enumerate(spans) if span.start + span.length > num_computed]
    if len(now) == len(spans):  # the whole request's images in the one call they always had
        embeds.embeds = list(model.encode_images(images.inputs))  # type: ignore[attr-defined]
        embeds.pending = [None] * len(spans)
        embeds.num_encoded = len(spans)
    elif now:
        first = sum(lengths[: now[0]])
        embeds.num_encoded = embeds.encode_for(first, sum(lengths) - first)
    return EncodedImages(prompt, embeds)


def fetched_embeddings(model: CausalLM, images: ImageEmbeddings, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Embeddings another instance encoded, checked against what this model's tower
    would make of the same grids (tokens per image, hidden size: a vision instance of
    another model would otherwise feed rows of the wrong width), on the model's device
    and in its dtype."""
    # A row's width: the hidden size, or more where the model's rows carry more than the
    # input embedding (Qwen3-VL's deepstack features beside it).
    hidden = getattr(model, "image_embedding_width", model.config.hidden_size)
    weight = model.model.embed_tokens.weight  # where and in what the forward adds them
    out = []
    for k, (embeds, length) in enumerate(zip(images.embeds, lengths)):
        if tuple(embeds.shape) != (length, hidden):
            raise InvalidParam("images", f"{k}: embeddings of shape {tuple(embeds.shape)} where this model takes "
                               f"({length}, {hidden})")  # fmt: skip
        out.append(embeds.to(device=weight.device, dtype=weight.dtype))
    return out


def check_prompt_tokens(model: CausalLM, prompt_ids: Sequence[int], has_images: bool) -> None:
    """Refuse what a vision-language prompt may hold that we do not serve: video
    placeholders, and image placeholders with no image to fill them."""
    vl = model.config.vision_language
    if vl is None:
        return
    if vl.video_token_id in prompt_ids:
        raise InvalidParam("prompt", f"holds video placeholder tokens ({vl.video_token_id}): video input is not "
                           "implemented")  # fmt: skip
    if not has_images and vl.image_token_id in prompt_ids:
        raise InvalidParam("prompt", f"holds image placeholder tokens ({vl.image_token_id}) but the request has "
                           "no images")  # fmt: skip


def content_hashes(inputs: ImageInputs) -> tuple[bytes, ...]:
    """Each image named by what the tower reads of it (its grid and its patches), for
    images given without an identity (offline generation): the same pixels through the
    same processor get the same name, so their KV is shared."""
    hashes = []
    for grid, patches in zip(inputs.grids, inputs.pixel_values.split([t * h * w for t, h, w in inputs.grids])):
        h = hashlib.blake2b(digest_size=32, person=b"infermesh-patch1")
        h.update(struct.pack("<3Q", *grid))
        h.update(str(patches.dtype).encode())
        h.update(patches.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        hashes.append(h.digest())
    return tuple(hashes)
