"""The model registry: one model file per architecture family over the shared layers
(nano-vllm's and vLLM's ``models/``), chosen by ``config.json``'s ``architectures``.

``FAMILIES`` is the one list. Each name ``n`` in it is two files side by side:

- ``models/n_config.py`` (torch-free): ``CONFIG``, an ``ArchConfig`` (shared/model/arch_config.py):
  the HF architectures it serves, its config parser, its make-model test configs;
- ``models/n.py``: ``ENTRY``, a ``ModelEntry`` (shared/model/interface.py): that config,
  the model class of each architecture, the KV layout declaration.

Today: ``llama`` (Llama, Qwen2, Qwen3, Mistral: one transformer, differences are data),
``qwen3_moe``, ``gpt_oss``, ``deepseek_v4`` (compressed attention, mHC; its own KV
groups), ``qwen2_5_vl`` (Qwen2's decoder, a vision tower, multimodal rotary
positions), ``qwen3_vl`` (Qwen3's decoder, its tower's deepstack features added after
the first layers, interleaved multimodal rotary). Everything else derives from the
list: the supported architectures, config parsing, the model classes, make-model's
architectures and presets, the CLI's choices.
Adding an architecture is its two files and one line here.

This module imports no torch (config parsing runs in the balancer, which has none): the
config modules are imported here, the model modules only when a model class is asked for.
"""

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from shared.model.arch_config import ArchConfig, ArchTraits
from shared.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from shared.model.interface import CausalLM, ModelEntry
    from shared.model.parallel import ParallelContext

FAMILIES: tuple[str, ...] = (
    "llama",
    "qwen3_moe",
    "gpt_oss",
    "deepseek_v4",
    "qwen2_5_vl",
    "qwen3_vl",
)
"""The model files, by module name (``shared/model/models/<name>.py`` and ``<name>_config.py``)."""

_FAMILY_CONFIGS: Mapping[str, ArchConfig] = MappingProxyType(
    {family: importlib.import_module(f"{__name__}.{family}_config").CONFIG for family in FAMILIES}
)
FAMILY_OF_ARCHITECTURE: Mapping[str, str] = MappingProxyType(
    {arch: family for family, config in _FAMILY_CONFIGS.items() for arch in config.architectures}
)
"""HF architecture name -> the name of its model file."""
ARCH_CONFIGS: Mapping[str, ArchConfig] = MappingProxyType(
    {arch: _FAMILY_CONFIGS[family] for arch, family in FAMILY_OF_ARCHITECTURE.items()}
)
"""HF architecture name -> its family's torch-free config (parser, traits, test configs)."""
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCH_CONFIGS)
ARCHITECTURE_OF_MODEL_TYPE: Mapping[str, str] = MappingProxyType(
    {traits.model_type: arch for config in _FAMILY_CONFIGS.values() for arch, traits in config.architectures.items()}
)
"""``model_type`` (also make-model's ``--arch``) -> HF architecture name."""
TEST_PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {name: preset for config in _FAMILY_CONFIGS.values() for name, preset in config.presets.items()}
)
"""make-model presets that belong to one family (each names its ``arch``)."""


def arch_traits(architecture: str) -> ArchTraits:
    """What ``architecture`` declares about itself (torch-free)."""
    return ARCH_CONFIGS[architecture].architectures[architecture]


def model_entry(architecture: str) -> "ModelEntry":
    """The ``ENTRY`` of the model file that serves ``architecture`` (imports torch)."""
    entry: ModelEntry = importlib.import_module(f"{__name__}.{FAMILY_OF_ARCHITECTURE[architecture]}").ENTRY
    return entry


def model_class(config: ModelConfig) -> "type[CausalLM]":
    return model_entry(config.architecture).model_classes[config.architecture]


def build_model(
    config: ModelConfig,
    dtype: "torch.dtype | None" = None,
    device: "torch.device | str" = "cpu",
    tie_word_embeddings: bool | None = None,
    kernels: str = "auto",
    parallel: "ParallelContext | None" = None,
    batch_invariant: bool = False,
) -> "CausalLM":
    """The model class of ``config.architecture``, built empty in ``dtype`` (default
    float32) on ``device``; ``parallel``: this rank's slice of a tensor-parallel model
    (None or one rank: the whole model, built exactly as without it).

    The one place a model's ops table is chosen, for its life: ``kernels`` ("auto",
    "triton", "torch"), or with ``batch_invariant`` the batch-invariant table over it
    (shared/model/batch_invariant.py; Llama-family models only, a ValueError otherwise)."""
    import torch

    cls = model_class(config)
    dtype = torch.float32 if dtype is None else dtype
    if parallel is None or not parallel.is_parallel:
        model = cls(config, dtype, device, tie_word_embeddings, kernels)
    else:
        cls.check_tensor_parallel(config, parallel.tp_size, expert_parallel=parallel.is_expert_parallel)
        model = cls(config, dtype, device, tie_word_embeddings, kernels, parallel=parallel)  # type: ignore[call-arg]
    if batch_invariant:
        from shared.model import batch_invariant as invariant  # imports torch: only for the model that asks

        invariant.apply(model)
    return model
