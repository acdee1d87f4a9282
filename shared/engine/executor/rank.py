"""What one rank of an instance builds, the same way in the engine's process (rank 0)
and in each worker: its device, its slice of the model, its model runner. One recipe
for both, so the ranks cannot drift apart in how they were built."""

from dataclasses import dataclass
from pathlib import Path

import torch

from shared.engine.config import EngineConfig
from shared.engine.dtypes import torch_dtype
from shared.engine.eplb.placement import PlacementSpec, initial_placement
from shared.engine.model_runner import ModelRunner
from shared.engine.structured.setup import make_grammar_compiler
from shared.model.expert_parallel_model import make_expert_parallel, rank_experts
from shared.model.interface import CausalLM
from shared.model.kept_weights import kept_formats
from shared.model.config import ModelConfig
from shared.model.loader import load_model
from shared.model.models import model_class
from shared.model.parallel import ParallelContext
from shared.recipe import Recipe


@dataclass(frozen=True, slots=True)
class RunnerSetup:
    """What rank 0 decided once its model was loaded, sent to every other rank so that
    each builds the same runner (the same KV pool shape, graphs, sampler seed)."""

    config: EngineConfig
    num_blocks: tuple[int, ...]
    """KV blocks per size class (coordinator.blocks_per_class)."""
    max_model_len: int
    eos_token_ids: frozenset[int]
    share_kv: bool = False
    """Make the rank's KV cache mappable on this host, for rank 0 to map (the instance has a
    KV connector: it moves every rank's blocks through rank 0's process, ranked_region.py)."""


def rank_device(device: str, rank: int, tp_size: int) -> torch.device:
    """The device of ``rank``: the engine's own with one rank; with several, CUDA rank r on
    the card r after the configured one (``cuda`` counts from card 0); the CPU for all."""
    base = torch.device(device)
    if tp_size == 1 or base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def check_split(config: EngineConfig, model_cfg: ModelConfig) -> None:
    """A ValueError saying why the model cannot split over config.num_ranks
    ranks as configured (expert parallelism: an MoE model whose experts divide over the
    ranks, and where its attention is tensor-parallel beside them, heads that split;
    else tensor parallelism: its family's check_tensor_parallel). Called before
    any rank starts, and by `infermesh up` before any instance starts."""
    if config.enable_expert_parallel:
        if model_cfg.moe is None:
            raise ValueError(f"enable_expert_parallel needs an MoE model: {model_cfg.architecture} has no experts")
        num_redundant = config.eplb_settings().num_redundant_experts
        PlacementSpec(config.num_ranks, num_redundant).check(model_cfg.moe.num_experts)
        if splits_attention(config, model_cfg):
            model_class(model_cfg).check_tensor_parallel(model_cfg, config.tensor_parallel_size, expert_parallel=True)
    else:
        model_class(model_cfg).check_tensor_parallel(model_cfg, config.tensor_parallel_size)


def splits_attention(config: EngineConfig, model_cfg: ModelConfig) -> bool:
    """Whether the instance's attention (and dense layers, embedding, head) is
    tensor-parallel over its ranks, each rank computing its query heads: with
    tensor_parallel_size > 1, always without expert parallelism; with it (vLLM's
    ``--tensor-parallel-size N --enable-expert-parallel``) where the family runs its
    attention tensor-parallel beside expert-parallel MoE layers
    (``CausalLM.splits_attention_with_experts``: Qwen3-MoE, GPT-OSS and DeepSeek-V4,
    whose one KV head and compressed caches stay whole on every rank,
    ``CausalLM.splits_kv_heads``). Never with data-parallel attention (each rank its
    own requests, data_parallel_size > 1)."""
    if config.tensor_parallel_size == 1 or config.data_parallel_size > 1:
        return False
    return not config.enable_expert_parallel or model_class(model_cfg).splits_attention_with_experts


def load_rank_model(config: EngineConfig, parallel: ParallelContext, device: torch.device, progress: bool) -> CausalLM:
    """This rank's model: its slice of config.model's checkpoint, with the engine's kernels
    (the batch-invariant table installed where asked). Expert-parallel: its attention and
    dense layers as ``parallel`` splits them (tensor-parallel, or whole), its MoE layers
    built whole, then each keeps its experts of the initial placement (``initial_placement``, the
    one the engine's ExpertBalancer starts from): only those are read from the files,
    and the rest of each layer's stacked experts is dropped."""

    def held_experts(model: CausalLM) -> list[list[int]]:
        return rank_experts(expert_placement_rows(config, model), parallel)

    model = load_model(
        config.model, dtype=torch_dtype(config.dtype), device=device, progress=progress, kernels=config.kernels,
        keep=kept_formats(config.quantized_weights, device), parallel=parallel,
        held_experts=held_experts if parallel.is_expert_parallel else None, batch_invariant=config.batch_invariant,
    )  # fmt: skip
    if parallel.is_expert_parallel:
        # Data-parallel attention: each rank's MoE layers take the rank's own tokens whole.
        split_tokens = config.data_parallel_size == 1
        make_expert_parallel(model, expert_placement_rows(config, model), parallel, split_tokens=split_tokens)
    return model


def expert_placement_rows(config: EngineConfig, model: CausalLM) -> list[list[int]]:
    """The initial placement's slot map, one row per MoE layer."""
    counts = model.expert_counts
    if counts is None:
        raise ValueError(f"expert parallelism needs MoE layers: {model.config.architecture} has none")
    spec = PlacementSpec(config.num_ranks, config.eplb_settings().num_redundant_experts)
    return initial_placement(counts.shape[0], counts.shape[1], spec).phy_to_log.tolist()


def build_runner(
    setup: RunnerSetup, model: CausalLM, device: torch.device, recipe: Recipe | None, share_kv: bool = False,
    rank: int = 0,
) -> ModelRunner:
    """The rank's runner over its model, with a grammar compiler from ``recipe`` (every rank
    samples structured requests as rank 0 does, so each masks them the same way). Its
    sampler's seed is the engine's, so that tensor-parallel ranks draw alike; with
    data-parallel attention each rank samples its own requests, and rank r's seed is the
    engine's + r, so that two ranks' unseeded requests do not draw the same noise."""
    config = setup.config
    seed = config.seed + (rank if config.data_parallel_size > 1 else 0)
    runner = ModelRunner(
        model,
        setup.num_blocks,
        config.block_size,
        torch_dtype(config.dtype),
        device,
        seed=seed,
        cuda_graphs=config.cuda_graphs,
        max_model_len=setup.max_model_len,
        max_batch=config.max_num_seqs,
        share_kv=share_kv,
        kv_share_dir=config.kv_share_dir,
        # With speculation a verify step (the last token and up to γ drafts) replays graphs too.
        max_graph_query=1 + config.spec_tokens if config.speculative != "none" else 1,
    )
    runner.structured.compiler = make_grammar_compiler(recipe, model.config.vocab_size, setup.eos_token_ids)
    return runner


def checkpoint_recipe(folder: str) -> Recipe | None:
    """The checkpoint's tokenizer and templates; None for one saved by transformers alone
    (no tokenizer.json: the engine then takes token ids only)."""
    return Recipe.from_pretrained(folder) if (Path(folder) / "tokenizer.json").is_file() else None
