"""Load a Hugging Face format checkpoint folder into the ``CausalLM`` of its architecture.

The folder holds ``config.json`` and either ``model.safetensors`` or shards named
by ``model.safetensors.index.json``. Loading goes in three steps:

1. the stored tensors become logical ones (shared/model/checkpoint_files.py): each
   quantised pair (FP8 weight + block scale, FP4 experts + group scale, MXFP4
   ``_blocks`` + ``_scales``), as config.json's ``quantization_config`` declares it, is
   one tensor, dequantised on the CPU when read;
2. the family's ``ModelEntry.checkpoint_names`` maps those names onto the names its
   ``checkpoint_tensors`` knows (DeepSeek-V4: DeepSeek's own spelling as well as
   transformers'), and sets aside what is not the model's (V4's ``mtp.*``);
3. each tensor is read from the memory-mapped files and copied into parameters already
   allocated in the target dtype and device, one at a time, so the peak memory is the
   model plus one tensor (in float32, for a quantised one). A tensor-parallel rank reads
   only its slice of each split tensor, an expert-parallel rank only the experts of its
   slots (shared/model/expert_loading.py), so N ranks read the checkpoint about once.

Every mismatch between checkpoint and config is a ``CheckpointError`` that names the
file or tensor. Quantised weights are dequantised to the model dtype, unless ``keep``
asks for FP8 linears or MXFP4 experts to stay as stored (on a GPU that runs them:
shared/model/kept_weights.py); then, before anything is read, the modules holding them
are rebuilt quantised, and the stored data and scales are copied in unconverted.
"""

import json
from collections.abc import Callable, Collection, Mapping, Sequence
import logging
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from shared.model.checkpoint_files import (
    INDEX_FILE, SINGLE_FILE, CheckpointError, CheckpointReader, TensorSource, logical_tensors, quant_scheme, tensor_files,
)  # fmt: skip
from shared.model.config import ModelConfig
from shared.model.expert_loading import ExpertReads, expert_reads, runs
from shared.model.kept_weights import KeptFormats, KeptTarget, keep_quantized
from shared.model.ops import resolve_ops
from shared.model.models import build_model, model_entry
from shared.model.interface import CausalLM
from shared.model.parallel import ParallelContext, Shard

__all__ = ["INDEX_FILE", "SINGLE_FILE", "CheckpointError", "load_model", "load_weights", "read_config"]

logger = logging.getLogger(__name__)

# Written by some exporters but recomputed by the model: never an error.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
_SHOWN = 8  # names listed in an error message before "..."


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = False,
    kernels: str = "auto",
    keep: KeptFormats = KeptFormats(),
    parallel: ParallelContext | None = None,
    held_experts: Callable[[CausalLM], Sequence[Collection[int]]] | None = None,
    batch_invariant: bool = False,
) -> CausalLM:
    """``kernels``: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".
    ``keep``: the quantised forms held as stored rather than dequantised (``kept_formats``
    of the engine's ``quantized_weights`` and the device; none by default).
    ``parallel``: load this rank's slice of a tensor-parallel model: each split tensor is
    checked at its full shape (from the file header), then only its slice
    (``CausalLM.checkpoint_shards``) read and copied.
    ``held_experts``: for an expert-parallel rank, the built model -> the experts each MoE
    layer keeps on this rank (its slots'); only those experts' bytes are read, the other
    rows of the stacked experts are left as allocated, for ``make_expert_parallel`` to
    drop. None: every expert is read.
    ``batch_invariant``: build it with the batch-invariant ops table (``build_model``)."""
    if keep.any and batch_invariant:
        # Kept weights get their own kernels after the build (FP8 GEMM, MXFP4 experts), not invariant ones.
        raise ValueError("batch_invariant runs float weights only: load quantized weights dequantised with it")
    if keep.any and parallel is not None and parallel.is_parallel:
        raise ValueError("not implemented yet: quantized weights kept as stored with tensor parallelism")
    folder = Path(path)
    config = read_config(folder)
    scheme = quant_scheme(folder)
    sources = model_sources(folder, config, logical_tensors(tensor_files(folder), scheme, folder))
    # Tie when the config says so, or when the checkpoint simply has no lm_head.
    # DeepSeek-V4 checkpoints (as transformers saves them) name the LM head head.weight.
    tie = config.tie_word_embeddings or not {"lm_head.weight", "head.weight"} & set(sources)
    if tie and not config.tie_word_embeddings:
        logger.warning("%s has no lm_head.weight: tying it to model.embed_tokens.weight", folder)
    model = build_model(config, dtype=dtype, device=device, tie_word_embeddings=tie, kernels=kernels, parallel=parallel,
                        batch_invariant=batch_invariant)
    with CheckpointReader(folder, scheme) as reader, torch.no_grad():
        kept: dict[str, KeptTarget] = {}
        if keep.any:
            block = scheme.block if scheme is not None else None
            kept = keep_quantized(model, sources, reader.stored_dtype, keep, block, resolve_ops(kernels, device))
        params = model.checkpoint_tensors(set(sources))
        shards = model.checkpoint_shards()
        picks = expert_reads(model, params, held_experts(model)) if held_experts is not None else ExpertReads({}, frozenset())
        _check_names(folder, set(params), set(sources) - _mtp_names(folder, config, sources), tie)
        # File by file (sorted), so the pages of one shard are read together.
        order = sorted((name for name in sources if name in params), key=lambda n: (sources[n].file, sources[n].data))
        for name in tqdm(order, desc="Loading weights", unit="tensor", file=sys.stderr, disable=not progress):
            source, param = sources[name], params[name]
            if name in kept:
                _copy_kept(folder, reader, source, kept[name])
                continue
            shape, shard = reader.shape(source), shards.get(name)
            if shape != _full_shape(param, shard):
                raise CheckpointError(
                    f"{folder / source.file}: tensor {source.data} has shape {shape}, expected "
                    f"{_full_shape(param, shard)} from config.json"
                )
            if name in picks.skipped:
                continue  # an expert held by another rank
            if name in picks.rows:
                for start, stop in runs(picks.rows[name]):
                    param[start:stop].copy_(reader.read(source, (slice(start, stop),)))
                continue
            # copy_ casts to the parameter's dtype and moves it to its device, one tensor at a time.
            if shard is None:
                param.copy_(reader.read(source))
            else:
                param.narrow(shard.dim, 0, shard.size).copy_(reader.read(source, shard.region()))
    return model.eval()


def _full_shape(target: torch.Tensor, shard: Shard | None) -> tuple[int, ...]:
    """The checkpoint tensor's shape that fills ``target`` (its whole, for a shard)."""
    shape = list(target.shape)
    if shard is not None:
        shape[shard.dim] = shard.full
    return tuple(shape)


def _copy(target: torch.Tensor, tensor: torch.Tensor, shard: Shard | None) -> None:
    """The tensor, or its shard's slice, into the target (a shard's padding rows past it stay)."""
    if shard is None:
        target.copy_(tensor)
    else:
        target.narrow(shard.dim, 0, shard.size).copy_(shard.take(tensor))


def _copy_kept(folder: Path, reader: CheckpointReader, source: TensorSource, target: KeptTarget) -> None:
    """The stored data and scale of a kept pair into the module's tensors, unconverted."""
    data, scale = reader.read_stored(source)
    for what, got, into in (("data", data, target.data), ("scale", scale, target.scale)):
        if tuple(got.shape) != tuple(into.shape):
            raise CheckpointError(
                f"{folder / source.file}: {source.data}'s {what} has shape {tuple(got.shape)}, expected "
                f"{tuple(into.shape)} from config.json"
            )
    target.data.copy_(data)
    target.scale.copy_(scale)


def model_sources(folder: Path, config: ModelConfig, sources: Mapping[str, TensorSource]) -> dict[str, TensorSource]:
    """The checkpoint's tensors under the model's names (the family's ``checkpoint_names``);
    the ones it sets aside are logged once."""
    names = model_entry(config.architecture).checkpoint_names(list(sources))
    aside = sorted(name for name, mapped in names.items() if mapped is None)
    if aside:
        logger.info("%s: %d tensors are not the model's and are not loaded with it: %s", folder, len(aside), _listing(aside))
    out: dict[str, TensorSource] = {}
    for name, mapped in names.items():
        if mapped is None:
            continue
        if mapped in out:
            raise CheckpointError(f"{folder}: {out[mapped].data} and {sources[name].data} both load into {mapped}")
        out[mapped] = sources[name]
    return out


@torch.no_grad()
def load_weights(model: CausalLM, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy checkpoint-named tensors already in memory (a transformers model's
    ``state_dict()``, say) into ``model``, with the same name checks as a folder."""
    targets = model.checkpoint_tensors(set(weights))
    shards = model.checkpoint_shards()
    _check_names("the weights given", set(targets), set(weights), tied=model.lm_head is None)
    for name, target in targets.items():
        if tuple(weights[name].shape) != _full_shape(target, shards.get(name)):
            raise CheckpointError(f"{name} has shape {tuple(weights[name].shape)}, expected {_full_shape(target, shards.get(name))}")
        _copy(target, weights[name], shards.get(name))


def read_config(folder: Path) -> ModelConfig:
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} has no config.json")
    try:
        return ModelConfig.from_pretrained(folder)
    except (ValueError, KeyError, TypeError) as e:
        what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        raise CheckpointError(f"{folder / 'config.json'}: {what}") from e


def _mtp_names(folder: Path, config: ModelConfig, names: Mapping[str, object]) -> set[str]:
    """The tensors of DeepSeek-layout MTP layers (``model.layers.{L + k}.*`` for k below
    config.json's ``num_nextn_predict_layers``): the MTP drafter's (shared/model/mtp.py),
    not the model's, so loading the model leaves them alone."""
    num_mtp = json.loads((folder / "config.json").read_text()).get("num_nextn_predict_layers") or 0
    prefixes = tuple(f"model.layers.{config.num_hidden_layers + k}." for k in range(int(num_mtp)))
    return {name for name in names if name.startswith(prefixes)} if prefixes else set()


def _check_names(folder: Path | str, expected: set[str], found: set[str], tied: bool) -> None:
    ignored = {n for n in found if n.endswith(_HARMLESS_SUFFIXES)}
    if tied:
        ignored.add("lm_head.weight")  # some exporters save the tied copy too
    missing = sorted(expected - found)
    if missing:
        raise CheckpointError(f"{folder}: {len(missing)} tensors missing from the checkpoint: {_listing(missing)}")
    unexpected = sorted(found - expected - ignored)
    if unexpected:
        raise CheckpointError(
            f"{folder}: {len(unexpected)} tensors the config does not use (wrong architecture or config?): "
            f"{_listing(unexpected)}"
        )


def _listing(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")
