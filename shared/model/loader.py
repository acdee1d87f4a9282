"""Load a Hugging Face format checkpoint folder into the ``CausalLM`` of its architecture.

The folder holds ``config.json`` and either ``model.safetensors`` or shards named
by ``model.safetensors.index.json``. Files are memory-mapped and copied tensor by
tensor into parameters already allocated in the target dtype and device, so the
peak memory is the model plus one tensor. Every mismatch between checkpoint and
config is a ``CheckpointError`` that names the file or tensor.
"""

import json
from collections.abc import Mapping
import logging
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from shared.model.config import ModelConfig
from shared.model.models import build_model
from shared.model.interface import CausalLM

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Written by some exporters but recomputed by the model: never an error.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
_SHOWN = 8  # names listed in an error message before "..."


class CheckpointError(ValueError):
    """The checkpoint folder cannot be loaded as given; the message says what to fix."""


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = False,
    kernels: str = "auto",
) -> CausalLM:
    """``kernels``: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch"."""
    folder = Path(path)
    config = read_config(folder)
    tensor_files = _tensor_files(folder)
    # Tie when the config says so, or when the checkpoint simply has no lm_head.
    # DeepSeek-V4 checkpoints (as transformers saves them) name the LM head head.weight.
    tie = config.tie_word_embeddings or not {"lm_head.weight", "head.weight"} & set(tensor_files)
    if tie and not config.tie_word_embeddings:
        logger.warning("%s has no lm_head.weight: tying it to model.embed_tokens.weight", folder)
    model = build_model(config, dtype=dtype, device=device, tie_word_embeddings=tie, kernels=kernels)
    params = model.checkpoint_tensors(set(tensor_files))
    _check_names(folder, set(params), set(tensor_files) - _mtp_names(folder, config, tensor_files), tie)

    by_file: dict[str, list[str]] = {}
    for name, file in tensor_files.items():
        if name in params:
            by_file.setdefault(file, []).append(name)
    with tqdm(total=len(params), desc="Loading weights", unit="tensor", file=sys.stderr, disable=not progress) as bar:
        for file, names in sorted(by_file.items()):
            try:
                _copy_tensors(folder / file, names, params, bar)
            except SafetensorError as e:
                raise CheckpointError(f"{folder / file} is not a readable safetensors file: {e}") from e
    return model.eval()


@torch.no_grad()
def load_weights(model: CausalLM, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy checkpoint-named tensors already in memory (a transformers model's
    ``state_dict()``, say) into ``model``, with the same name checks as a folder."""
    targets = model.checkpoint_tensors(set(weights))
    _check_names("the weights given", set(targets), set(weights), tied=model.lm_head is None)
    for name, target in targets.items():
        target.copy_(weights[name])


def _copy_tensors(file: Path, names: list[str], params: dict[str, torch.Tensor], bar: tqdm) -> None:
    with safe_open(str(file), framework="pt", device="cpu") as f:
        present = set(f.keys())
        for name in sorted(names):
            if name not in present:
                raise CheckpointError(f"{file}: the index names tensor {name} in this file, but it is not there")
            param = params[name]
            shape = tuple(f.get_slice(name).get_shape())
            if shape != tuple(param.shape):
                raise CheckpointError(
                    f"{file}: tensor {name} has shape {shape}, expected {tuple(param.shape)} from config.json"
                )
            # copy_ casts to the parameter's dtype and moves it to its device, one tensor at a time.
            with torch.no_grad():
                param.copy_(f.get_tensor(name))
            bar.update()


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


def _tensor_files(folder: Path) -> dict[str, str]:
    """Tensor name -> the file (relative to folder) that holds it."""
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


def _mtp_names(folder: Path, config: ModelConfig, names: Mapping[str, str]) -> set[str]:
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
