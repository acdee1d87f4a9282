"""Engine dataclasses <-> protobuf messages, in one place."""

import io

import numpy as np
from PIL import Image

from shared.engine.eplb.expert_load import ExpertLoad
from shared.engine.outputs import TokenLogprobs
from shared.engine.sampling_params import SamplingParams
from shared.engine.structured.spec import StructuredSpec
from shared.kv.block_hash import HASH_BYTES
from shared.multimodal.decode import decode_image
from shared.multimodal.errors import ImageError
from shared.proto import mesh_pb2


def params_to_proto(p: SamplingParams) -> mesh_pb2.SamplingParams:
    msg = mesh_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        min_tokens=p.min_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        logit_bias=p.logit_bias,
        allowed_token_ids=p.allowed_token_ids or (),
        bad_words=[mesh_pb2.TokenIds(token_ids=word) for word in p.bad_words_token_ids],
    )
    if p.top_k is not None:
        msg.top_k = p.top_k
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.seed is not None:
        msg.seed = p.seed
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.structured is not None:
        s = p.structured
        msg.structured.CopyFrom(mesh_pb2.StructuredOutput(kind=s.kind, source=s.source, compact=not s.any_whitespace))
    return msg


def params_from_proto(msg: mesh_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (from SamplingParams) for values out of range."""
    return SamplingParams(
        max_tokens=msg.max_tokens,
        min_tokens=msg.min_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else None,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        seed=msg.seed if msg.HasField("seed") else None,
        logit_bias=dict(msg.logit_bias),
        allowed_token_ids=list(msg.allowed_token_ids) or None,
        bad_words_token_ids=[list(word.token_ids) for word in msg.bad_words],
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        structured=_structured_from_proto(msg.structured) if msg.HasField("structured") else None,
    )


def _structured_from_proto(msg: mesh_pb2.StructuredOutput) -> StructuredSpec:
    """Raises ValueError (from StructuredSpec) for an unknown kind."""
    return StructuredSpec(msg.kind, msg.source, any_whitespace=not msg.compact)  # type: ignore[arg-type]


def logprobs_to_proto(lp: TokenLogprobs) -> mesh_pb2.TokenLogprobs:
    return mesh_pb2.TokenLogprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top_token_ids=[t for t, _ in lp.top],
        top_logprobs=[v for _, v in lp.top],
    )


def logprobs_from_proto(msg: mesh_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=msg.token_id,
        logprob=msg.logprob,
        rank=msg.rank,
        top=list(zip(msg.top_token_ids, msg.top_logprobs)),
    )


def expert_load_to_proto(load: ExpertLoad) -> mesh_pb2.ExpertLoad:
    """Per layer the mean and max tokens per rank and their ratio (the heartbeat's
    figures), not every rank's count: mesh.proto's ExpertLoad says why."""
    layers = [
        mesh_pb2.LayerExpertLoad(mean_tokens_per_rank=mean, max_tokens_per_rank=round(top), balancedness=balance)
        for mean, top, balance in zip(load.mean_tokens_per_rank(), load.max_tokens_per_rank(), load.balancedness())
    ]
    return mesh_pb2.ExpertLoad(num_ranks=load.num_ranks, window_steps=load.window_steps, layers=layers,
                               num_rebalances=load.num_rebalances, num_redundant_experts=load.num_redundant_experts)


def image_to_proto(pixels: np.ndarray, identity: bytes) -> mesh_pb2.ImageData:
    """An image for the wire: its RGB pixels (uint8, height x width x 3) as a PNG, lossless
    so the receiver's processor sees the very pixels the identity names. Milliseconds
    per image: call it off the event loop."""
    height, width, channels = pixels.shape
    if pixels.dtype != np.uint8 or channels != 3:
        raise ValueError(f"pixels must be uint8 height x width x 3, got {pixels.dtype} {pixels.shape}")
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels), "RGB").save(out, "PNG")
    return mesh_pb2.ImageData(png=out.getvalue(), height=height, width=width, hash=identity)


def image_from_proto(msg: mesh_pb2.ImageData, param: str) -> np.ndarray:
    """The image's pixels (uint8, height x width x 3, read-only), decoded by the front
    door's own decoder. ValueError naming param for an identity that is not 32 bytes or
    a PNG that is not the height x width the message says (a sender's bug, refused
    rather than encoded into another image's KV). Call it off the event loop."""
    if len(msg.hash) != HASH_BYTES:
        raise ValueError(f"{param}: an image's identity is {HASH_BYTES} bytes, got {len(msg.hash)}")
    try:
        pixels = decode_image(msg.png, param, max_pixels=msg.height * msg.width)
    except ImageError as exc:
        raise ValueError(str(exc)) from None
    if pixels.shape != (msg.height, msg.width, 3):
        got = f"{pixels.shape[1]}x{pixels.shape[0]}"
        raise ValueError(f"{param}: the PNG is {got}, not the {msg.width}x{msg.height} sent")
    return pixels
