"""Expert-parallel cases (tests/parity/test_expert_parallel.py): the MoE blocks of the
three MoE families from make-model's test configs with seeded weights, tokens split
over ranks as data-parallel attention splits them, and the worker that runs them in
real processes over a gloo group on 127.0.0.1.

Every process builds the same blocks and tokens from the same seeds, so the test
process computes the single-process reference and each rank its share, and they
meet only through the files the ranks write."""

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shared.engine.eplb.placement import PlacementSpec, compute_placement
from shared.model import batch_invariant
from shared.model.config import ModelConfig
from shared.model.expert_dispatch import AllToAllDispatcher
from shared.model.expert_parallel import ExpertParallelExperts, ExpertShard, install_expert_parallel, move_experts
from shared.model.models.deepseek_v4 import v4_moe
from shared.model.models.gpt_oss import gpt_oss_mlp
from shared.model.models.qwen3_moe import qwen3_moe_mlp
from shared.model.moe import SparseMoE
from shared.model.ops import TORCH_OPS
from tools.make_model import PRESETS, hf_config_dict

NUM_TOKENS = 21
SPLITS = {2: (13, 8), 4: (7, 0, 9, 5)}
"""Local tokens per rank: uneven, and one rank with none (it still joins every collective)."""
FAMILIES = {"qwen3_moe": ("qwen3_moe", 0), "gpt_oss": ("gpt_oss", 0), "v4_hash": ("deepseek_v4", 0),
            "v4_topk": ("deepseek_v4", 1)}  # fmt: skip
"""Case family -> (make-model arch, layer): DeepSeek-V4's layer 0 is hash-routed, 1 top-k."""
SKEWED_LOAD = np.array([[400.0, 10.0, 150.0, 3.0, 90.0, 6.0, 250.0, 30.0]])
"""Tokens per expert that make EPLB replicate the hot experts (0, 6, 2)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class Case:
    family: str
    invariant: bool
    world: int
    placement: str  # "static" or "eplb"
    dtype: str = "float32"

    @property
    def name(self) -> str:
        mode = "invariant" if self.invariant else "default"
        return f"{self.family}-{mode}-ep{self.world}-{self.placement}-{self.dtype}"


CASES = [
    Case(family, invariant, world, placement)
    for family in FAMILIES
    for invariant in (False, True)
    for world in (2, 4)
    for placement in ("static", "eplb")
] + [Case("qwen3_moe", True, 4, "eplb", "bfloat16"), Case("gpt_oss", True, 2, "eplb", "bfloat16")]
SWITCH_FAMILIES = ("qwen3_moe", "gpt_oss", "v4_topk")
"""Families whose switch case runs: static placement, then a move to EPLB's, same tokens."""


def model_config(arch: str) -> ModelConfig:
    preset = {**PRESETS["tiny"], "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "num_hidden_layers": 2}  # fmt: skip
    return ModelConfig.from_dict(hf_config_dict(arch, preset, "float32", None, None))


def moe_block(family: str, dtype: str, invariant: bool, seed: int = 0) -> SparseMoE:
    """The family's MoE block as its model builds it, weights drawn from ``seed``; the
    batch-invariant kernels installed when ``invariant``."""
    arch, layer = FAMILIES[family]
    config = model_config(arch)
    make = {"qwen3_moe": qwen3_moe_mlp, "gpt_oss": gpt_oss_mlp, "deepseek_v4": v4_moe}[arch]
    block = make(config, layer, DTYPES[dtype], torch.device("cpu"), TORCH_OPS)
    assert isinstance(block, SparseMoE)
    g = torch.Generator().manual_seed(seed)
    num_experts = block.experts.moe.num_experts
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("tid2eid"):
                p.copy_(torch.rand(p.shape[0], num_experts, generator=g).argsort(-1)[:, : p.shape[1]])
            else:
                # Router rows large enough that the choice of experts varies from token to token.
                scale = 1.0 if name.startswith(f"{block.router_name}.") else 0.1
                p.copy_(scale * torch.randn(p.shape, generator=g))
    if invariant:
        batch_invariant.install(block, batch_invariant.invariant_ops(triton=False))
    block.counts = torch.zeros(num_experts, dtype=torch.int64)
    return block


def tokens(family: str, dtype: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [NUM_TOKENS, hidden], input ids [NUM_TOKENS])."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(NUM_TOKENS, 64, generator=g).to(DTYPES[dtype])
    return x, torch.randint(0, 256, (NUM_TOKENS,), generator=g)


def local_range(world: int, rank: int) -> slice:
    sizes = SPLITS[world]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def slot_experts(world: int, placement: str) -> torch.Tensor:
    """The logical expert of each physical slot: the static placement, or EPLB's for
    SKEWED_LOAD with one redundant expert per rank."""
    if placement == "static":
        return torch.arange(SKEWED_LOAD.shape[1])
    chosen = compute_placement(SKEWED_LOAD, PlacementSpec.per_rank(world, 1))
    return torch.from_numpy(chosen.phy_to_log[0].copy())


def run_case(case: Case, rank: int, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    block = moe_block(case.family, case.dtype, case.invariant)
    shard = ExpertShard.from_slots(slot_experts(case.world, case.placement), 8, case.world, rank)
    install_expert_parallel(block, shard, AllToAllDispatcher(group))
    x, input_ids = tokens(case.family, case.dtype)
    mine = local_range(case.world, rank)
    out = block(x[mine], input_ids[mine])
    assert block.counts is not None
    return {"out": out, "counts": block.counts.clone()}


def run_switch(family: str, rank: int, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """A step on the static placement, a move of the weights to EPLB's and a switch, the
    same step again; also whether the moved weights are the full copy's."""
    world = dist.get_world_size(group)
    block = moe_block(family, "float32", invariant=True)
    full = block.experts
    static = ExpertShard.contiguous(8, world, rank)
    install_expert_parallel(block, static, AllToAllDispatcher(group))
    experts = block.experts
    assert isinstance(experts, ExpertParallelExperts)
    x, input_ids = tokens(family, "float32")
    mine = local_range(world, rank)
    before = block(x[mine], input_ids[mine])
    eplb = ExpertShard.from_slots(slot_experts(world, "eplb"), 8, world, rank)
    moved = move_experts(static, experts.local, eplb, group)
    expected = full.select(eplb.local_experts())
    same = all(torch.equal(moved.stacked()[k], v) for k, v in expected.stacked().items())
    experts.switch(eplb, moved)
    after = block(x[mine], input_ids[mine])
    return {"before": before, "after": after, "moved_weights_match": torch.tensor(same)}


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of the group: every case of EP size 2 (ranks 0-1) and 4, outputs into
    ``out_dir/<case>-<rank>.pt``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # Every rank creates every group (new_group is collective), then runs the cases of its groups.
    groups = {size: dist.new_group(list(range(size))) for size in sorted(SPLITS) if size <= world}
    with torch.inference_mode():
        for case in CASES:
            if case.world in groups and rank < case.world:
                torch.save(run_case(case, rank, groups[case.world]), Path(out_dir) / f"{case.name}-{rank}.pt")
        for family in SWITCH_FAMILIES:
            torch.save(run_switch(family, rank, groups[world]), Path(out_dir) / f"switch-{family}-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
