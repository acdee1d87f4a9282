"""DeepSeek-V4's KV bytes per token and blocks in a fixed budget: every cache padded to
the widest row in one pool (before) against a size class per page size (now).

Computed from a make-model preset's config alone (no weights drawn: v4-flash-8l is
15B parameters), by the layout the engine uses (``v4_kv_layout``,
``KVCacheLayout.elements_per_block``); "before" is the padded layout as the model
declared it until the size classes: one [2, blocks, block_size, 1, widest] tensor per
cache index, every group drawing block ids from one pool.

    python -m tools.bench.raw_file --out docs/perf/v4_kv_pages_cpu_2026-12-06.txt -- \\
        python -m tools.bench.v4_kv_pages --preset v4-flash-8l
"""

import argparse

from shared.kv.spec import KVCacheLayout
from shared.model.config import ModelConfig
from shared.model.models.deepseek_v4 import entry_width, state_row, v4_kv_layout
from shared.model.models.deepseek_v4_config import SLIDING
from tools.make_model import PRESETS, hf_config_dict


def v4_config(preset: str) -> ModelConfig:
    dims = PRESETS[preset]
    return ModelConfig.from_dict(hf_config_dict(dims["arch"], dims, "bfloat16", 0, 1))


def padded_width(config: ModelConfig) -> int:
    """The one row width of the padded layout: the widest state row's plane 0 or entry."""
    p = config.deepseek_v4
    assert p is not None
    entries = [entry_width(config, t) for t in p.layer_types if t != SLIDING]
    return max([state_row(config, t).plane0 for t in p.layer_types] + entries)


def figures(config: ModelConfig, layout: KVCacheLayout, block_size: int, element_size: int, budget: int) -> list[str]:
    groups = len(layout.groups)
    # Before: a block id spans group_size tensors of 2 planes of the widest row, and a
    # token's block in every group is a block id of its own.
    before_block = layout.group_size * 2 * block_size * padded_width(config) * element_size
    before_blocks = budget // before_block
    before_token = groups * before_block / block_size
    # Now: each size class has num_blocks blocks of its own rows.
    now_block = layout.elements_per_block(block_size) * element_size
    now_blocks = budget // now_block
    assert layout.rows is not None
    true_token = sum(r.elements for r in layout.rows) * element_size
    now_token = now_block / block_size  # every group is a size class of its own (shared/kv/spec.py)
    lines = [
        f"caches: {layout.num_layers} ({len(layout.sliding_groups)} state groups, "
        f"{len(layout.persistent_groups)} compressed), groups of {layout.group_size}; "
        f"size classes: {len(layout.size_classes)}",
        f"block_size {block_size}, {element_size}-byte elements, budget {budget / 2**30:.1f} GiB",
        f"sum of the caches' true row widths: {true_token} bytes per token",
        "",
        f"{'layout':<28}{'bytes/token':>14}{'blocks in budget':>20}{'tokens in every group':>24}",
        f"{'padded, one pool (before)':<28}{before_token:>14.0f}{before_blocks:>20}{before_blocks // groups * block_size:>24}",
        f"{'size classes (now)':<28}{now_token:>14.0f}{now_blocks:>20}{now_blocks * block_size:>24}",
        "",
        f"bytes per token now / before: {now_token / before_token:.3f}; "
        f"tokens held in every group now / before: {now_blocks * groups / before_blocks:.2f}x",
        "(blocks in budget: before, block ids shared by all groups, so a token's block in every",
        " group takes one each; now, per size class, i.e. per group)",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="v4-flash-8l")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (the engine's default)")
    parser.add_argument("--element-size", type=int, default=2, help="bytes per element (bfloat16: 2)")
    parser.add_argument("--budget-gib", type=float, default=40.0)
    args = parser.parse_args(argv)
    config = v4_config(args.preset)
    layout = v4_kv_layout(config)
    budget = int(args.budget_gib * 2**30)
    print(f"preset {args.preset}")
    print("\n".join(figures(config, layout, args.block_size, args.element_size, budget)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
