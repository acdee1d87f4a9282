"""What a checkpoint folder holds, as the tensors a model loads.

``tensor_files``: each stored tensor name -> its file (``model.safetensors`` or the
shards of ``model.safetensors.index.json``). ``QuantScheme``: config.json's
``quantization_config``. ``logical_tensors`` folds each quantised pair into the one
tensor it stands for, named as the unquantised checkpoint would name it:

- ``fp8``: ``X.weight`` with ``X.scale`` (DeepSeek's spelling) or ``X.weight_scale_inv``
  (transformers' and DeepSeek-V3's) -> ``X.weight``; e4m3 data is block-scaled
  (``weight_block_size``), int8 data is DeepSeek-V4's packed FP4 experts (groups of 32);
- ``mxfp4``: ``X_blocks`` with ``X_scales`` -> ``X`` (GPT-OSS's experts), laid out as
  transformers' mxfp4 integration returns it: the blocks hold the rows of the transposed
  weight, so the tensor is [..., cols, rows] of the stored grid.

``CheckpointReader`` reads one logical tensor at a time from the memory-mapped files,
dequantising on the CPU (shared/model/quantized.py), so loading needs the model plus one
tensor. Every inconsistency is a ``CheckpointError`` that names the tensor.
"""

import fnmatch
import json
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from shared.model import quantized

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
QUANT_METHODS = ("fp8", "mxfp4")
_FP8_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_MX_BLOCKS, _MX_SCALES = "_blocks", "_scales"


class CheckpointError(ValueError):
    """The checkpoint folder cannot be loaded as given; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """config.json's ``quantization_config``, the part loading needs."""

    method: str
    """``fp8`` (block-scaled e4m3, FP4 experts) or ``mxfp4``."""
    block: tuple[int, int] | None
    """fp8: the [rows, cols] tile one scale covers (``weight_block_size``)."""
    not_converted: tuple[str, ...]
    """mxfp4: ``modules_to_not_convert`` (module names, ``*`` wildcards), kept unquantised."""

    @staticmethod
    def from_config(d: Mapping[str, Any] | None, where: str) -> "QuantScheme | None":
        """None without a ``quantization_config``; ``where`` names config.json in errors."""
        if d is None:
            return None
        method = d.get("quant_method")
        if method not in QUANT_METHODS:
            raise CheckpointError(
                f"{where}: quantization_config.quant_method {method!r} is not supported "
                f"(supported: {', '.join(QUANT_METHODS)})"
            )
        block = None
        if method == "fp8":
            size = d.get("weight_block_size")
            if not (isinstance(size, list | tuple) and len(size) == 2 and all(isinstance(n, int) and n > 0 for n in size)):
                raise CheckpointError(f"{where}: fp8 quantization_config needs weight_block_size [rows, cols], got {size!r}")
            if d.get("activation_scheme", "dynamic") != "dynamic":
                raise CheckpointError(
                    f"{where}: fp8 activation_scheme {d['activation_scheme']!r}: only dynamic (no stored activation scales)"
                )
            block = (size[0], size[1])
        return QuantScheme(method, block, tuple(d.get("modules_to_not_convert") or ()))


@dataclass(frozen=True, slots=True)
class TensorSource:
    """One tensor a model loads: a stored tensor, or a quantised pair read as one."""

    data: str
    """The stored tensor (the quantised values, for a pair)."""
    file: str
    scale: str | None = None
    """The stored scale tensor of a pair; None for a plain tensor."""
    scale_file: str | None = None
    mxfp4: bool = False
    """``_blocks``/``_scales`` (read back transposed, as transformers' GPT-OSS expects)."""


def tensor_files(folder: Path) -> dict[str, str]:
    """Stored tensor name -> the file (relative to folder) that holds it."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index_path} is not a safetensors index (no weight_map): {e}") from e
        for file in sorted(set(weight_map.values())):
            if not (folder / file).is_file():
                raise CheckpointError(f"shard {file} named in {index_path} is missing from {folder}")
        return dict(weight_map)
    single = folder / SINGLE_FILE
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt", device="cpu") as f:
                return {name: SINGLE_FILE for name in f.keys()}
        except SafetensorError as e:
            raise CheckpointError(f"{single} is not a readable safetensors file: {e}") from e
    others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = f" (found {', '.join(others)}: only safetensors is supported)" if others else ""
    raise CheckpointError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")


def quant_scheme(folder: Path) -> QuantScheme | None:
    config = json.loads((folder / "config.json").read_text())
    return QuantScheme.from_config(config.get("quantization_config"), str(folder / "config.json"))


def logical_tensors(files: Mapping[str, str], scheme: QuantScheme | None, folder: Path | str) -> dict[str, TensorSource]:
    """Logical tensor name -> where it is stored. A scale without its data, quantised data
    without its scale (an FP8 e4m3 tensor is checked by dtype, in ``CheckpointReader``),
    or a pair the config does not declare, is a ``CheckpointError`` naming the tensor."""
    fp8_scales = {n: n.removesuffix(s) + ".weight" for n in files for s in _FP8_SCALE_SUFFIXES if n.endswith(s)}
    mx_blocks = {n for n in files if n.endswith(_MX_BLOCKS)}
    mx_scales = {n for n in files if n.endswith(_MX_SCALES) and n.removesuffix(_MX_SCALES) + _MX_BLOCKS in files}
    # Without a quantization_config, a stored "X.scale" beside "X.weight" is a pair all the
    # same: refuse it rather than copy e4m3 codes as if they were weights.
    paired = {s for s, w in fp8_scales.items() if w in files} | mx_blocks
    if scheme is None and paired:
        raise CheckpointError(
            f"{folder}: config.json has no quantization_config, but the checkpoint has quantised tensors "
            f"({', '.join(sorted(paired)[:4])})"
        )
    method = scheme.method if scheme else None
    sources: dict[str, TensorSource] = {}
    used: set[str] = set()
    if method == "fp8":
        for scale, weight in sorted(fp8_scales.items()):
            if weight not in files:
                raise CheckpointError(f"{folder}: scale {scale} has no {weight} beside it")
            if weight in sources:
                raise CheckpointError(f"{folder}: {weight} has two scales ({sources[weight].scale} and {scale})")
            sources[weight] = TensorSource(weight, files[weight], scale, files[scale])
            used |= {weight, scale}
    elif method == "mxfp4":
        for blocks in sorted(mx_blocks):
            name = blocks.removesuffix(_MX_BLOCKS)
            scales = name + _MX_SCALES
            if scales not in files:
                raise CheckpointError(f"{folder}: {blocks} has no {scales} beside it")
            module = name.rpartition(".")[0]
            pattern = next((p for p in scheme.not_converted if fnmatch.fnmatchcase(module, p)), None)  # type: ignore[union-attr]
            if pattern is not None:
                raise CheckpointError(
                    f"{folder}: {blocks} is MXFP4, but quantization_config.modules_to_not_convert lists {pattern!r}"
                )
            sources[name] = TensorSource(blocks, files[blocks], scales, files[scales], mxfp4=True)
            used |= {blocks, scales}
        stray = sorted(n for n in files if n.endswith(_MX_SCALES) and n not in mx_scales)
        if stray:
            raise CheckpointError(f"{folder}: {stray[0]} has no {stray[0].removesuffix(_MX_SCALES) + _MX_BLOCKS} beside it")
    for name, file in files.items():
        if name not in used:
            sources[name] = TensorSource(name, file)
    return sources


class CheckpointReader:
    """The folder's files, opened (memory-mapped) once each while the reader is entered;
    ``shape`` and ``read`` take a ``TensorSource``."""

    def __init__(self, folder: Path, scheme: QuantScheme | None) -> None:
        self.folder, self.scheme = folder, scheme
        self._stack = ExitStack()
        self._open: dict[str, Any] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _file(self, file: str) -> Any:
        if file not in self._open:
            try:
                self._open[file] = self._stack.enter_context(safe_open(str(self.folder / file), framework="pt", device="cpu"))
            except SafetensorError as e:
                raise CheckpointError(f"{self.folder / file} is not a readable safetensors file: {e}") from e
        return self._open[file]

    def _slice(self, name: str, file: str) -> Any:
        f = self._file(file)
        if name not in f.keys():
            raise CheckpointError(f"{self.folder / file}: the index names tensor {name} in this file, but it is not there")
        return f.get_slice(name)

    def shape(self, source: TensorSource) -> tuple[int, ...]:
        """The logical tensor's shape, from the file headers (nothing read)."""
        data = self._slice(source.data, source.file)
        shape = tuple(data.get_shape())
        if source.scale is None:
            fp4 = self.scheme is not None and self.scheme.method == "fp8" and data.get_dtype() == "I8"
            if data.get_dtype() in ("F8_E4M3", "F8_E5M2") or fp4:
                raise CheckpointError(
                    f"{self.folder / source.file}: {source.data} is {data.get_dtype()} but has no scale "
                    f"({source.data.removesuffix('.weight')}.scale or .weight_scale_inv) beside it"
                )
            return shape
        if source.mxfp4:
            *lead, rows, groups, _ = shape
            return (*lead, groups * quantized.FP4_GROUP, rows)
        if data.get_dtype() in ("I8", "U8"):
            return (*shape[:-1], 2 * shape[-1])
        return shape

    def stored_dtype(self, source: TensorSource) -> str:
        """The stored data's safetensors dtype ("F8_E4M3", "U8", "BF16"...), from the header."""
        return str(self._slice(source.data, source.file).get_dtype())

    def read_stored(self, source: TensorSource) -> tuple[torch.Tensor, torch.Tensor]:
        """A quantised pair as stored, for a model that keeps it (shared/model/kept_weights.py):
        FP8 e4m3 [..., rows, cols] with float32 block scales (E8M0 read as the powers of two
        they are), or FP4 (MXFP4 blocks flattened, or DeepSeek's int8 experts) as uint8
        [..., rows, cols / 2] with the uint8 exponent scales [..., rows, cols / 32]. The scale's shape is checked as ``read`` checks it."""
        if source.scale is None or source.scale_file is None:
            raise CheckpointError(f"{self.folder / source.file}: {source.data} is not quantised: nothing to keep")
        data = self._slice(source.data, source.file)[:]
        scale = self._slice(source.scale, source.scale_file)[:]
        where = f"{self.folder / source.file}: {source.data} with {source.scale}"
        if source.mxfp4:
            if data.dtype != torch.uint8 or scale.dtype != torch.uint8 or data.shape[-1] != quantized.FP4_GROUP // 2:
                raise CheckpointError(f"{where}: MXFP4 wants uint8 blocks [..., groups, 16] and uint8 scales")
            if tuple(scale.shape) != tuple(data.shape[:-1]):
                raise CheckpointError(f"{where}: scales {tuple(scale.shape)} do not fit blocks {tuple(data.shape)}")
            return data.flatten(-2), scale
        if data.dtype in (torch.int8, torch.uint8):
            # DeepSeek-V4's FP4 experts: the MXFP4 layout already flattened, E8M0 scales.
            expected_groups = (*data.shape[:-1], 2 * data.shape[-1] // quantized.FP4_GROUP)
            if scale.dtype not in (quantized.E8M0_DTYPE, torch.uint8) or tuple(scale.shape) != expected_groups:
                raise CheckpointError(
                    f"{where}: FP4 kept packed needs E8M0 scales {expected_groups}, got {scale.dtype} {tuple(scale.shape)}"
                )
            return data.view(torch.uint8), scale.view(torch.uint8)
        assert self.scheme is not None and self.scheme.block is not None
        if data.dtype != quantized.FP8_DTYPE:
            raise CheckpointError(f"{where}: only FP8 e4m3 and FP4 pairs are kept as stored, this is {data.dtype}")
        expected = quantized.fp8_scale_shape(tuple(data.shape), self.scheme.block)
        if tuple(scale.shape) != expected:
            raise CheckpointError(f"{where}: scale shape {tuple(scale.shape)}, expected {expected}")
        try:
            return data, quantized.scale_values(scale)
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from e

    def read(self, source: TensorSource, region: tuple[slice, ...] = ()) -> torch.Tensor:
        """The logical tensor, or only ``region`` of it (ranges of its leading dims, as a
        tensor-parallel shard or an expert-parallel rank's experts): stored as is, or
        dequantised to float32. Safetensors' slices read only their range of the mapped
        file, so a plain tensor's region is all that is read; so is a quantised one's when
        the region cuts only dim 0 of a stack ([E, ...] experts: data and scales are cut
        alike). Any other quantised region (its scale tiles need not line up with the cut)
        is cut from the whole tensor once dequantised."""
        data_slice = self._slice(source.data, source.file)
        if source.scale is None or source.scale_file is None:
            return data_slice[region] if region else data_slice[:]
        scale_slice = self._slice(source.scale, source.scale_file)
        stack_cut = len(region) == 1 and len(data_slice.get_shape()) >= 3
        data = data_slice[region] if stack_cut else data_slice[:]
        scale = scale_slice[region] if stack_cut else scale_slice[:]
        try:
            if source.mxfp4:
                whole = quantized.dequantize_mxfp4(data, scale).transpose(-1, -2)
            elif data.dtype in (torch.int8, torch.uint8):
                whole = quantized.dequantize_fp4_groups(data, scale)
            else:
                assert self.scheme is not None and self.scheme.block is not None
                whole = quantized.dequantize_fp8_blocks(data, scale, self.scheme.block)
        except ValueError as e:
            raise CheckpointError(f"{self.folder / source.file}: {source.data} with {source.scale}: {e}") from e
        return whole if stack_cut or not region else whole[region]
