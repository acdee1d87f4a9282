"""bench-batch-invariant: the cost of batch-invariant mode (issue 14, point 3).

For each batch size, the same greedy requests (seeded token-id prompts) run on one
engine in the normal mode and on one with batch_invariant=True, each once untimed
(warm-up) then timed: output tokens per second of the whole batch, side by side,
with the slowdown. The two modes' tokens are compared too (they are the same
function in another reduction order; a differing token is reported, not a failure).

On CUDA the invariant engine runs the Triton table (kernels/invariant_matmul.py,
kernels/invariant_attention.py) under CUDA graphs; on the plain CPU the PyTorch one.
``--matmul`` adds the op-level cost on CUDA: the invariant matmul against F.linear
(cuBLAS) for a Llama-3-8B layer's weights and the logits' product, M from 1 to 8192,
with the M bucket (and its tile configuration) each M ran with. ``--matmul-sweep``
times, per weight, block_k (64, 128) and M, the candidate tiles of SWEEP_TILES (all on
wgmma, all within Hopper's shared memory) and prints the fastest: the data to choose
matmul_family's buckets from (a family keeps one block_k for every M); it then (and
``--persistent-sweep`` alone) times the persistent TMA kernel's candidate tiles
(kernels/invariant_matmul_tma.py) at prefill M (2048, 8192) with each weight's own
block_k, against cuBLAS and the weight's current prefill tile, each candidate checked
bitwise against that tile: the data to set PERSISTENT_TILES from.

  python -m tools.bench.batch_invariant_bench --model models/trained/target --device cpu --batch 1 8
  python -m tools.bench.batch_invariant_bench --model /path/to/llama --device cuda --dtype bfloat16 --batch 1 8 64 --matmul
  python -m tools.bench.batch_invariant_bench --device cuda --dtype bfloat16 --batch 1 --max-tokens 4 --matmul-sweep
  python -m tools.bench.batch_invariant_bench --device cuda --dtype bfloat16 --batch 1 --max-tokens 4 --persistent-sweep
"""

import argparse
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tools.bench.raw_file import write_json

if TYPE_CHECKING:
    from shared.model.kernels.invariant_matmul import MatmulConfig


@dataclass(slots=True)
class Row:
    batch: int
    normal_tok_s: float
    invariant_tok_s: float
    same_tokens: bool

    @property
    def slowdown(self) -> float:
        return self.normal_tok_s / self.invariant_tok_s


def _requests(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed + batch)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def _timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    llm.generate(prompts, params)  # warm-up: allocations, kernels, caches
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds, [o.token_ids for o in outs]


def run(model: str, device: str, dtype: str, batches: list[int], prompt_len: int, max_tokens: int) -> list[Row]:
    knobs = dict(device=device, dtype=dtype, enable_prefix_caching=False)  # the warm-up must not turn into hits
    normal = LLM(model, **knobs)
    invariant = LLM(model, batch_invariant=True, **knobs)
    vocab = normal.engine.model.config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for batch in batches:
        prompts = _requests(batch, prompt_len, vocab, seed=0)
        fast, fast_tokens = _timed(normal, prompts, params)
        slow, slow_tokens = _timed(invariant, prompts, params)
        rows.append(Row(batch, fast, slow, fast_tokens == slow_tokens))
    return rows


MATMUL_SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
"""Llama-3-8B's weights [N, K] (q, k, v and gate, up stacked, as the model runs them)."""
MATMUL_ROWS = (1, 8, 32, 128, 256, 512, 2048, 8192)


def matmul_table(dtype: str) -> list[tuple[str, int, float, float, str]]:
    """(weight, M, F.linear us, invariant us, bucket) on the current CUDA device, each
    time the median of triton's do_bench (warm-ups and repeats, L2 flushed between runs);
    bucket: the index of M's tile configuration in the weight's family, and the tiles."""
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from shared.model.kernels.invariant_matmul import invariant_matmul, matmul_family

    torch_dtype = getattr(torch, dtype)
    rows = []
    for name, (n, k) in MATMUL_SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch_dtype) * 0.02
        family = matmul_family(n, k, torch_dtype)
        for m in MATMUL_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch_dtype)
            normal = do_bench(lambda: F.linear(x, w), return_mode="median") * 1000  # noqa: B023
            invariant = do_bench(lambda: invariant_matmul(x, w), return_mode="median") * 1000  # noqa: B023
            rows.append((name, m, normal, invariant, f"{family.bucket(m)} {family.config(m)}"))
        del w
    return rows


SWEEP_TILES: dict[int, tuple[tuple[int, int, int, int], ...]] = {
    64: ((64, 64, 4, 4), (64, 64, 4, 6), (64, 64, 4, 8), (64, 128, 4, 3), (64, 128, 4, 5), (64, 256, 4, 3),
         (128, 64, 4, 4), (128, 128, 4, 4), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (128, 256, 8, 4)),
    128: ((64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 6), (64, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 4),
          (128, 128, 4, 3), (128, 128, 8, 3)),
}  # fmt: skip
"""(block_m, block_n, num_warps, num_stages) per block_k: tiles on wgmma (BLOCK_M a multiple
of 64, 4 or 8 warps) within Hopper's shared memory, decode-shaped to prefill-shaped."""


def sweep_configs(block_k: int) -> list["MatmulConfig"]:
    """SWEEP_TILES[block_k] as configurations."""
    from shared.model.kernels.invariant_matmul import SHARED_MEMORY_BYTES, MatmulConfig

    configs = [MatmulConfig(bm, bn, block_k, 8, w, s) for bm, bn, w, s in SWEEP_TILES[block_k]]
    assert all(c.shared_memory_bytes <= SHARED_MEMORY_BYTES for c in configs)
    return configs


def matmul_sweep(dtype: str) -> list[tuple[str, int, int, float, float, str]]:
    """(weight, block_k, M, F.linear us, fastest invariant us, its tiles) per weight,
    block_k and M (MATMUL_ROWS), over sweep_configs."""
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from shared.model.kernels.invariant_matmul import invariant_matmul

    torch_dtype = getattr(torch, dtype)
    rows = []
    for name, (n, k) in MATMUL_SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch_dtype) * 0.02
        for m in MATMUL_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch_dtype)
            normal = do_bench(lambda: F.linear(x, w), return_mode="median") * 1000  # noqa: B023
            for block_k in (64, 128):
                timed = []
                for c in sweep_configs(block_k):
                    try:
                        run = lambda: invariant_matmul(x, w, config=c)  # noqa: B023, E731
                        us = do_bench(run, warmup=5, rep=20, return_mode="median") * 1000
                    except Exception as error:  # noqa: BLE001 (out of resources: skip that tile)
                        print(f"  {name} M={m} {c}: {type(error).__name__}")
                        continue
                    timed.append((us, str(c)))
                best_us, best = min(timed)
                rows.append((name, block_k, m, normal, best_us, best))
        del w
    return rows


PREFILL_ROWS = (2048, 8192)
"""M of the persistent sweep: prefill chunks."""


@dataclass(slots=True)
class PersistentRow:
    weight: str
    m: int
    cublas_us: float
    current: str
    """The weight's current tile for M (the tile kernel's, PERSISTENT_PREFILL off)."""
    current_us: float
    timed: list[tuple[float, "MatmulConfig", bool]]
    """(us, tile, bitwise equal to the current tile's output) per candidate that ran."""
    failed: list[str]
    """'tile: error' per candidate that did not compile or launch."""

    @property
    def best(self) -> tuple[float, "MatmulConfig", bool] | None:
        """The fastest candidate whose rows are bitwise the current tile's, if any."""
        same = [t for t in self.timed if t[2]]
        return min(same, key=lambda t: t[0]) if same else None


def persistent_candidates(block_k: int) -> list["MatmulConfig"]:
    """The persistent kernel's tiles worth timing with a weight's block_k: BLOCK_M and
    BLOCK_N 128 or 256 (not both: 256x256 does not fit), 8 warps (two warpgroups on
    wgmma), 3 to 5 stages, within Hopper's shared memory with the output tile's staging
    buffer, whole where it fits, else in halves (the epilogue subtile)."""
    from shared.model.kernels.invariant_matmul import SHARED_MEMORY_BYTES, MatmulConfig

    configs = []
    for bm, bn in ((128, 128), (128, 256), (256, 128)):
        for stages in (3, 4, 5):
            for subtile in (False, True):
                c = MatmulConfig(bm, bn, block_k, 8, 8, stages, persistent=True, epilogue_subtile=subtile)
                if c.shared_memory_bytes <= SHARED_MEMORY_BYTES:
                    configs.append(c)
                    break
    return configs


def persistent_sweep(dtype: str) -> list[PersistentRow]:
    """Per weight (MATMUL_SHAPES) and M (PREFILL_ROWS): F.linear, the current prefill tile
    and every persistent candidate with the weight's block_k, each the median of
    triton's do_bench; a candidate that fails to compile or launch is reported, not fatal."""
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from shared.model.kernels.invariant_matmul import invariant_matmul, matmul_family

    torch_dtype = getattr(torch, dtype)
    rows = []
    for name, (n, k) in MATMUL_SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch_dtype) * 0.02
        family = matmul_family(n, k, torch_dtype, persistent=False)
        candidates = persistent_candidates(family.block_k)
        for m in PREFILL_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch_dtype)
            current = family.config(m)
            cublas = do_bench(lambda: F.linear(x, w), return_mode="median") * 1000  # noqa: B023
            reference = invariant_matmul(x, w, config=current)
            tiled = lambda: invariant_matmul(x, w, config=current)  # noqa: B023, E731
            current_us = do_bench(tiled, return_mode="median") * 1000
            row = PersistentRow(name, m, cublas, str(current), current_us, [], [])
            for c in candidates:
                try:
                    same = torch.equal(invariant_matmul(x, w, config=c), reference)
                    run = lambda: invariant_matmul(x, w, config=c)  # noqa: B023, E731
                    us = do_bench(run, warmup=5, rep=20, return_mode="median") * 1000
                except Exception as error:  # noqa: BLE001 (out of resources, a compile error: next tile)
                    first_line = (str(error).splitlines() or [""])[0][:120]
                    row.failed.append(f"{c}: {type(error).__name__}: {first_line}")
                    continue
                row.timed.append((us, c, same))
            rows.append(row)
            _print_persistent(row)  # as it goes: a crash later still leaves these lines
            del x, reference
        del w
    return rows


def _print_persistent(r: PersistentRow) -> None:
    head = (f"{r.weight:>8} {r.m:>5} cuBLAS {r.cublas_us:>8.1f} us | current {r.current} {r.current_us:>8.1f} us "
            f"{r.current_us / r.cublas_us:>5.2f}x")  # fmt: skip
    best = r.best
    if best is None:
        print(f"{head} | no persistent tile ran bitwise equal")
    else:
        us, tile, _ = best
        print(f"{head} | best persistent {tile} {us:>8.1f} us {us / r.cublas_us:>5.2f}x cuBLAS, "
              f"{us / r.current_us:>5.2f}x current")  # fmt: skip
    for us, tile, same in sorted(r.timed, key=lambda t: t[0]):
        print(f"{'':>10}{str(tile):<26} {us:>8.1f} us {us / r.cublas_us:>5.2f}x{'' if same else '  NOT BITWISE EQUAL'}")
    for failure in r.failed:
        print(f"{'':>10}{failure}")


PERSISTENT_KEYS = {"lm_head": "logits"}
"""MATMUL_SHAPES' names that PERSISTENT_TILES spells otherwise."""


def print_persistent_suggestion(rows: list[PersistentRow]) -> None:
    """PERSISTENT_TILES as the sweep would set them: per weight the fastest bitwise tile
    at the largest M, from the weight's current first persistent edge, with what it
    gains on the current tiles at each M (a weight it does not speed up keeps the tile
    kernel: drop its entry)."""
    from shared.model.kernels.invariant_matmul import PERSISTENT_TILES

    print("\nPERSISTENT_TILES from this sweep (then PERSISTENT_PREFILL = None):")
    for name in MATMUL_SHAPES:
        mine = [r for r in rows if r.weight == name]
        if not mine or mine[-1].best is None:
            print(f"    # {name}: no persistent tile ran bitwise equal")
            continue
        _, c, _ = mine[-1].best
        gains = []
        for r in mine:
            same = [us for us, tile, ok in r.timed if tile == c and ok]
            gains.append(f"M {r.m}: {same[0] / r.current_us:.2f}x current" if same else f"M {r.m}: not timed")
        key = PERSISTENT_KEYS.get(name, name)
        edge = PERSISTENT_TILES[key][0][0]
        tile = (c.block_m, c.block_n, c.num_warps, c.num_stages, c.epilogue_subtile)
        print(f'    "{key}": (({edge}, {tile}),),  # {", ".join(gains)}')


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the seeded tiny model, made in a temp folder)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--matmul", action="store_true", help="also the op-level matmul table (CUDA)")
    parser.add_argument("--matmul-sweep", action="store_true", help="also the tile sweep per block_k and M, then the "
                        "persistent sweep (CUDA)")  # fmt: skip
    parser.add_argument("--persistent-sweep", action="store_true", help="also the persistent kernel's tiles at prefill "
                        "M per weight (CUDA)")  # fmt: skip
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="the batch table, under the raw-file header (the matmul tables only print)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tools.make_model import make_model

            make_model(tmp)
            model = tmp
        rows = run(model, args.device, args.dtype, args.batch, args.prompt_len, args.max_tokens)
    print(f"model {args.model or 'tiny (make_model)'} on {args.device} ({args.dtype}), prompt {args.prompt_len}, "
          f"{args.max_tokens} tokens each, greedy")  # fmt: skip
    print(f"{'batch':>5} {'normal tok/s':>13} {'invariant tok/s':>16} {'slowdown':>9} {'same tokens':>12}")
    for r in rows:
        print(f"{r.batch:>5} {r.normal_tok_s:>13.1f} {r.invariant_tok_s:>16.1f} {r.slowdown:>8.2f}x {str(r.same_tokens):>12}")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        write_json(args.json, {"rows": [{**asdict(r), "slowdown": r.slowdown} for r in rows], "settings": settings})
    if args.matmul:
        print(f"\nmatmul x[M, K] @ W[N, K]^T ({args.dtype}): F.linear (cuBLAS) vs invariant_matmul, median us")
        print(f"{'weight':>8} {'N x K':>13} {'M':>5} {'F.linear':>9} {'invariant':>10} {'ratio':>7}  bucket: tiles")
        for name, m, normal_us, invariant_us, bucket in matmul_table(args.dtype):
            n, k = MATMUL_SHAPES[name]
            print(f"{name:>8} {f'{n}x{k}':>13} {m:>5} {normal_us:>9.1f} {invariant_us:>10.1f} "
                  f"{invariant_us / normal_us:>6.2f}x  {bucket}")  # fmt: skip
    if args.matmul_sweep:
        print(f"\nmatmul tile sweep ({args.dtype}): the fastest tiles per weight, block_k and M, median us")
        print(f"{'weight':>8} {'block_k':>7} {'M':>5} {'F.linear':>9} {'fastest':>8} {'ratio':>7}  tiles")
        for name, block_k, m, normal_us, best_us, best in matmul_sweep(args.dtype):
            ratio = best_us / normal_us
            print(f"{name:>8} {block_k:>7} {m:>5} {normal_us:>9.1f} {best_us:>8.1f} {ratio:>6.2f}x  {best}")
    if args.matmul_sweep or args.persistent_sweep:
        print(f"\npersistent TMA matmul sweep ({args.dtype}): per weight and M, cuBLAS, the current prefill tile and "
              "the fastest persistent tile of the weight's block_k whose output is bitwise the current tile's "
              "(then every candidate, fastest first), median us")  # fmt: skip
        print_persistent_suggestion(persistent_sweep(args.dtype))


if __name__ == "__main__":
    main()
