"""DeepSeek-V4's KV bytes per token and tokens in a fixed budget, layout by layout:

1. every cache padded to the widest row in one pool (until the size classes);
2. a size class per page size, a row per raw token in every cache (until i27-pools);
3. compressed caches keep only their entries, block_size / rate rows a block (one when the
   rate exceeds the block: ``KVCacheLayout.block_rows``);
4. and the state caches' classes get the blocks max_num_seqs requests hold of the window
   (``coordinator.blocks_per_class``): a fixed cost, no longer one row per token.

Computed from a make-model preset's config alone (no weights drawn: v4-flash-8l is
15B parameters), by the layout and the sizing the engine uses (``v4_kv_layout``,
``class_elements_per_block``, ``blocks_in_budget``). "Tokens" are tokens every group
holds: the persistent classes' blocks times block_size (the state classes hold the
window of each running request, whatever its length).

    python -m tools.bench.raw_file --out docs/perf/v4_kv_pages_pools_cpu_2026-12-06.txt -- \\
        python -m tools.bench.v4_kv_pages --preset v4-flash-8l
"""

import argparse

from shared.kv.memory.coordinator import blocks_in_budget, blocks_per_class
from shared.kv.spec import KVCacheLayout
from shared.model.config import ModelConfig
from shared.model.models.deepseek_v4 import entry_width, state_row, v4_kv_layout
from shared.model.models.deepseek_v4_config import SLIDING
from tools.bench.raw_file import add_json_flag, write_rows
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


def figures(
    config: ModelConfig, layout: KVCacheLayout, block_size: int, element_size: int, budget: int,
    max_num_seqs: int, max_step_tokens: int,
) -> tuple[list[dict[str, float | int | str]], list[str]]:
    """The layouts' rows (for --json) and the printed lines."""
    groups = len(layout.groups)
    assert layout.rows is not None
    true_token = sum(r.elements for r in layout.rows) * element_size
    # 1. A block id spans group_size tensors of 2 planes of the widest row, and a token's
    # block in every group is a block id of its own.
    padded_block = layout.group_size * 2 * block_size * padded_width(config) * element_size
    padded_blocks = budget // padded_block
    # 2. Each class num_blocks blocks of block_size rows of its own width.
    classes_block = block_size * true_token
    # 3. As 2, a compressed class's block at its entries.
    class_bytes = [e * element_size for e in layout.class_elements_per_block(block_size)]
    # 4. As 3, the state classes at blocks_per_class.
    num_blocks = blocks_in_budget(layout, class_bytes, budget, block_size, max_num_seqs, max_step_tokens)
    counts = blocks_per_class(layout, num_blocks, block_size, max_num_seqs, max_step_tokens)
    fixed = sum(n * b for n, b in zip(counts, class_bytes) if n < num_blocks)
    marginal = sum(b for n, b in zip(counts, class_bytes) if n == num_blocks) / block_size
    rows = [
        ("1. padded, one pool", padded_block * groups / block_size, 0, padded_blocks // groups * block_size),
        ("2. size classes", classes_block / block_size, 0, budget // classes_block * block_size),
        ("3. + compressed entries", sum(class_bytes) / block_size, 0, budget // sum(class_bytes) * block_size),
        ("4. + window state pools", marginal, fixed, num_blocks * block_size),
    ]
    state = [c for c, n in enumerate(counts) if n < num_blocks]
    lines = [
        f"caches: {layout.num_layers} ({len(layout.sliding_groups)} state groups, "
        f"{len(layout.persistent_groups)} compressed), groups of {layout.group_size}; "
        f"size classes: {len(layout.size_classes)}",
        f"block_size {block_size}, {element_size}-byte elements, budget {budget / 2**30:.1f} GiB; "
        f"for 4: max_num_seqs {max_num_seqs}, max_num_batched_tokens {max_step_tokens}",
        f"sum of the caches' true row widths: {true_token} bytes per token",
        f"rows per block by class: {[layout.block_rows(c, block_size) for c in range(len(layout.size_classes))]}",
        f"4's blocks by class: {list(counts)} (state classes {state}: "
        f"{max_num_seqs} x (ceil(W / bs) + 2) + 2 x ceil(T / bs), W = {layout.max_window})",
        "",
        f"{'layout':<28}{'bytes/token':>14}{'fixed bytes':>16}{'tokens in budget':>20}",
    ]
    lines += [f"{name:<28}{per_token:>14.0f}{fixed_bytes:>16}{tokens:>20}" for name, per_token, fixed_bytes, tokens in rows]
    lines += [
        "",
        "bytes/token: what one more token of every group costs (4: the persistent classes');",
        "fixed bytes: the state classes' pools, held whatever the requests' lengths.",
        f"tokens in budget 4 / 2: {rows[3][3] / rows[1][3]:.2f}x; 4 / 1: {rows[3][3] / rows[0][3]:.2f}x",
    ]
    keys = ("layout", "bytes_per_token", "fixed_bytes", "tokens_in_budget")
    return [dict(zip(keys, row)) for row in rows], lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="v4-flash-8l")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (the engine's default)")
    parser.add_argument("--element-size", type=int, default=2, help="bytes per element (bfloat16: 2)")
    parser.add_argument("--budget-gib", type=float, default=40.0)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the engine's default")
    parser.add_argument("--max-step-tokens", type=int, default=8192, help="max_num_batched_tokens (CUDA default)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    config = v4_config(args.preset)
    layout = v4_kv_layout(config)
    budget = int(args.budget_gib * 2**30)
    print(f"preset {args.preset}")
    rows, lines = figures(config, layout, args.block_size, args.element_size, budget, args.max_num_seqs,
                          args.max_step_tokens)
    print("\n".join(lines))
    write_rows(args.json, rows, preset=args.preset, block_size=args.block_size, budget_bytes=budget)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
