"""A request's images made ready for the engine: checked against its prompt, their
M-RoPE positions computed and the vision tower run over them (``encode``).

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


@dataclass(frozen=True, slots=True)
class EncodedImages:
    prompt: PromptImages
    embeds: torch.Tensor
    """[the prompt's image tokens, hidden]: every image's embeddings, in prompt order."""


def encode(model: CausalLM, prompt_ids: Sequence[int], images: RequestImages, speculative: str) -> EncodedImages:
    """The prompt's images, checked and encoded. InvalidParam("images") where the model
    takes none, speculative decoding is on, or the prompt's placeholder runs do not
    match the images (count, or tokens per image: the processor's grid / merge**2)."""
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
    if isinstance(images.inputs, ImageEmbeddings):  # encoded by a vision instance (E/P/D): no tower here
        embeds = fetched_embeddings(model, images.inputs, lengths)
    else:
        embeds = model.encode_images(images.inputs)  # type: ignore[attr-defined]
    return EncodedImages(PromptImages(tuple(spans), positions), torch.cat(embeds))


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
