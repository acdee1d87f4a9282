"""DeepSeek-V4 in the engine on one GPU (issue 12, point 7): whole-engine decode tok/s
at a few batch sizes, the TTFT of one long prompt, and where a step's time goes by
kind of work, all in one run on one checkpoint.

On the H200: make-model's ``v4-flash-8l`` (V4-Flash's layout at 8 layers and 64
experts: 15.1B parameters, 3.4B active, 30 GB in bfloat16) is drawn on the GPU into
--model when that folder holds no checkpoint, then loaded by the engine as a service
loads it. One call of the device machine, carrying .whl/ (as tools/bench/h200.sh):

    mkdir -p $OUT/v4 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl && PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 \
      timeout 560 python3 -m tools.bench.v4_bench --preset v4-flash-8l --model models/v4-flash-8l \
      --device cuda --out $OUT/v4 2>&1 | tee $OUT/v4/v4_bench.log

Defaults: decode at batch 1 and 64 over prompts of 1024-1027 tokens (staggered so
that each step closes some CSA windows), 32 timed steps each; one 8192-token prompt
(in one step: the step budget is the prompt), timed twice after a warm-up. Estimated
for the H200: drawing ~1 min, loading ~20 s, capturing the decode graphs (buckets up to
the largest batch) under a minute, benching 1-2 min; memory: 30 GB of weights, 7.5 GB
of KV pool, and for the 8k prefill a few GB of transients (the batched attention gathers
each row's keys in row chunks of at most compressed_batch.GATHER_BUDGET elements). If
they would not fit, the prompt is halved until they do, and the output says so.

The breakdown comes from the PyTorch profiler over one or a few engine steps: the
model wraps its parts in ranges (shared/model/profiling.py's ``profiled``), and each CUDA
kernel counts under the innermost range that launched it ("outside the layers": the
embedding, the LM head, sampling, input copies): by the torch op it hangs off, or, for a
Triton kernel (launched from Python, in no op), by the range's GPU-side annotation that
holds it (``attribute``). Beside it, the host's time in each
range (exclusive, inflated by the profiler). On the CPU (the test's tiny V4) there are
no kernels and only host time is reported. The step's wall time is the un-profiled one
from the timed run.

Decode runs on CUDA graphs by default (--cuda-graphs; V4 captures on the Triton table:
fused MoE, fused mHC, batched compressed attention), and the timed steps replay them. A
replayed graph hides the model's ranges from the profiler, so the profiled decode steps
run eagerly (the same kernels, launched one by one): the breakdown says where the
kernels' time goes, the timed run what a graphed step costs. The report states the
mode run and whether the timed steps replayed graphs.
"""

import argparse
import bisect
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch

from shared.engine.config import EngineConfig
from shared.engine.engine_request import EngineRequest
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.kv.memory.coordinator import blocks_for_one_request
from shared.model.compressed_batch import GATHER_BUDGET
from shared.model.loader import INDEX_FILE, SINGLE_FILE
from shared.model.moe import Experts
from tools.bench.engine_bench import _prompts, _sync
from tools.bench.raw_file import run_header, write_json, write_text
from tools.bench.v4_kv_bytes import logical_bytes

# Profiler range (shared/model/models/deepseek_v4.py, shared/model/moe.py) -> what it holds.
KINDS: Mapping[str, str] = MappingProxyType(
    {
        "v4.attention": "attention: q/kv/o projections, rope, state writes",
        "v4.attention.core": "attention: window + compressed entries, batched",
        "v4.compressor": "compressors: projections, entries",
        "v4.indexer": "indexer: scores, top-k",
        "moe.router": "MoE: router",
        "moe.experts": "MoE: routed experts",
        "moe.shared_experts": "MoE: shared expert",
        "v4.moe": "MoE: counts, other",
        "v4.mhc": "mHC: mixes, Sinkhorn, merges, head",
        "v4.norm": "norms",
    }
)
OUTSIDE = "outside the layers: embedding, LM head, sampling, copies"


@dataclass(slots=True)
class Breakdown:
    """Milliseconds per step by kind (KINDS' keys, then OUTSIDE)."""

    num_steps: int
    host_ms: dict[str, float]
    host_total_ms: float
    """The profiled window's wall time per step (the profiler slows the host)."""
    device_ms: dict[str, float] | None = None
    """Kernel time; None without a GPU."""
    device_total_ms: float | None = None
    top_kernels_ms: list[tuple[str, float]] = field(default_factory=list)


@dataclass(slots=True)
class Decode:
    batch: int
    context: int
    num_steps: int
    num_tokens: int
    seconds: float
    breakdown: Breakdown
    graphed: bool = False
    """Whether the last timed step replayed a CUDA graph (the profiled ones run eagerly)."""

    @property
    def tok_s(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def step_ms(self) -> float:
        return self.seconds / self.num_steps * 1e3


@dataclass(slots=True)
class Prefill:
    prompt_len: int
    ttft_s: list[float]
    breakdown: Breakdown

    @property
    def median_ttft_s(self) -> float:
        return sorted(self.ttft_s)[len(self.ttft_s) // 2]

    @property
    def tok_s(self) -> float:
        return self.prompt_len / self.median_ttft_s


def model_figures(engine: LLMEngine) -> dict[str, float]:
    """Parameters (all, and active per token: top_k of the routed experts, the rest
    whole, the embedding included) and KV bytes per raw token."""
    model, config, block = engine.model, engine.model.config, engine.config.block_size
    p, moe = config.deepseek_v4, config.moe
    assert p is not None and moe is not None, "not a DeepSeek-V4 model"
    weights = [t for t in model.parameters() if t.is_floating_point()]
    total = sum(t.numel() for t in weights)
    routed = sum(t.numel() for m in model.modules() if isinstance(m, Experts) for t in m.parameters())
    kv_dtype = engine.runner.kv_caches[0].dtype
    element = kv_dtype.itemsize
    # Each group's bytes per raw token, from its size class's own rows (a group of
    # the one shared class, where rows are alike, spans that class's tensors).
    layout = model.kv_layout
    classes = layout.class_rows()  # V4 declares every cache's row
    per_token = [sum(r.elements for r in classes[c]) * element for c in layout.size_class_of_group]
    sliding = set(layout.sliding_groups)
    compressed_per_token = sum(b for g, b in enumerate(per_token) if g not in sliding)
    sliding_per_token = sum(b for g, b in enumerate(per_token) if g in sliding)
    logical = logical_bytes(p, config.head_dim, element)
    return {
        "params": total,
        "active_params": total - routed + routed * moe.top_k / moe.num_experts,
        "kv_logical_bytes_per_token": logical.compressed,
        "kv_window_bytes_per_token": logical.window,
        "kv_pool_bytes_per_token": compressed_per_token,
        "kv_state_bytes_per_request": (-(-p.state_window // block) + 1) * block * sliding_per_token,
    }


def _range_of(event) -> str | None:  # noqa: ANN001 - a torch FunctionEvent
    while event is not None:
        if event.name in KINDS:
            return event.name
        event = event.cpu_parent
    return None


@dataclass(slots=True)
class Attributed:
    """Microseconds of a profiled window by range (KINDS' keys), exclusive of nested ranges."""

    host_us: dict[str, float]
    kernels_us: dict[str, float]
    kernels_total_us: float
    """Every kernel and copy of the window, in a range or not."""
    by_kernel_us: dict[str, float]


class _GpuRanges:
    """The ranges' GPU-side annotations of one device: each spans, on the GPU's clock, the
    kernels launched while its range was open on the host (the profiler draws it from
    them), however late they ran. A kernel's range is the latest-starting annotation that
    contains it: on one stream kernels run in launch order, so that is the innermost range
    open when it was launched."""

    def __init__(self, annotations: list) -> None:  # noqa: ANN001 - torch FunctionEvents
        self._spans = sorted(annotations, key=lambda a: a.time_range.start)
        self._starts = [a.time_range.start for a in self._spans]
        # The latest end among spans[:i + 1]: once it is before a kernel's end, no earlier span holds it.
        self._reach: list[float] = []
        for a in self._spans:
            self._reach.append(max(a.time_range.end, self._reach[-1] if self._reach else a.time_range.end))

    def innermost(self, kernel) -> str | None:  # noqa: ANN001 - a torch FunctionEvent
        """The range of the latest-starting span holding ``kernel``, one on its own stream
        first (another stream's span may only overlap it in time)."""
        start, end = kernel.time_range.start, kernel.time_range.end
        stream = getattr(kernel, "device_resource_id", None)
        fallback = None
        j = bisect.bisect_right(self._starts, start) - 1
        while j >= 0 and self._reach[j] >= end:
            span = self._spans[j]
            if span.time_range.end >= end:
                if getattr(span, "device_resource_id", None) == stream:
                    return span.name
                fallback = fallback or span.name
            j -= 1
        return fallback


def attribute(events: Iterable) -> Attributed:  # noqa: ANN001 - torch FunctionEvents
    """Each kernel under the innermost range that launched it; each range's host time
    less its nested ranges'.

    A kernel hangs off the CPU op that launched it only when the profiler linked the two
    by correlation id, which it does for launches inside a torch op: a Triton kernel
    launched straight from Python inside a ``record_function`` range has no op to hang
    off, and it runs after the range has closed on the host, so the host's clock cannot
    place it either. Such a kernel counts under the range whose GPU-side annotation
    (``is_user_annotation``, named as the range, on the GPU's clock) holds it; a kernel
    under neither is outside the layers."""
    from torch.autograd import DeviceType

    host = dict.fromkeys(KINDS, 0.0)
    kernels = dict.fromkeys(KINDS, 0.0)
    total = 0.0
    by_kernel: dict[str, float] = {}
    ops: dict[int, list] = {}
    device_kernels: list = []
    annotations: dict[int, list] = {}
    for ev in events:
        if ev.device_type == DeviceType.CPU:
            # Ops carry their own correlation id and no link (launch calls carry a link).
            if not getattr(ev, "is_async", False) and not getattr(ev, "linked_correlation_id", 0):
                ops.setdefault(ev.id, []).append(ev)
            if ev.name in KINDS:
                host[ev.name] += ev.cpu_time_total
                outer = _range_of(ev.cpu_parent)
                if outer is not None:
                    host[outer] -= ev.cpu_time_total
        elif getattr(ev, "is_user_annotation", False) or ev.name in KINDS:
            # A range's GPU-side annotation: where its kernels ran, not work of its own.
            if ev.name in KINDS:
                annotations.setdefault(ev.device_index, []).append(ev)
        else:
            device_kernels.append(ev)
    gpu_ranges = {device: _GpuRanges(spans) for device, spans in annotations.items()}
    for k in device_kernels:
        duration = k.time_range.elapsed_us()
        total += duration
        by_kernel[k.name] = by_kernel.get(k.name, 0.0) + duration
        # Ids are per kind (ops', the driver's), so one id may name a launch call too: the
        # first of the id's events that sits in a range is the op.
        linked = getattr(k, "linked_correlation_id", 0)
        name = next((r for op in ops.get(linked, ()) if (r := _range_of(op)) is not None), None) if linked else None
        if name is None and k.device_index in gpu_ranges:
            name = gpu_ranges[k.device_index].innermost(k)
        if name is not None:
            kernels[name] += duration
    return Attributed(host, kernels, total, by_kernel)


def profile_steps(run: Callable[[], int], device: str) -> Breakdown:
    """run() takes engine steps and returns how many: their time by kind, per step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        num_steps = run()
        _sync(device)
        wall_us = (time.perf_counter() - start) * 1e6
    a = attribute(prof.events())
    per_step = 1e-3 / max(num_steps, 1)
    host_ms = {k: v * per_step for k, v in a.host_us.items()}
    host_ms[OUTSIDE] = wall_us * per_step - sum(host_ms.values())
    breakdown = Breakdown(num_steps, host_ms, wall_us * per_step)
    if cuda:
        device_ms = {k: v * per_step for k, v in a.kernels_us.items()}
        device_ms[OUTSIDE] = a.kernels_total_us * per_step - sum(device_ms.values())
        breakdown.device_ms, breakdown.device_total_ms = device_ms, a.kernels_total_us * per_step
        top = sorted(a.by_kernel_us.items(), key=lambda kv: -kv[1])[:12]
        breakdown.top_kernels_ms = [(n, us * per_step) for n, us in top]
    return breakdown


def _drain(engine: LLMEngine, request_ids: list[str]) -> None:
    for rid in request_ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def bench_decode(
    engine: LLMEngine, batch: int, context: int, num_steps: int, seed: int, num_profiled: int | None = None
) -> Decode:
    """`batch` requests of prompts of context..context+3 tokens (staggered: each step
    closes some CSA windows, as a real batch does) decoding together: once every one
    has its first token, 2 steps untimed, `num_steps` timed, then `num_profiled`
    profiled (default 4 // batch, at least 1: a large batch's step launches tens of
    thousands of kernels, and the profiler's report on them takes a while)."""
    vocab = engine.model.config.vocab_size
    num_profiled = num_profiled or max(1, 4 // batch)
    params = SamplingParams(max_tokens=num_steps + num_profiled + 8, temperature=0.0, ignore_eos=True)
    prompts = _prompts(batch, context + 3, vocab, seed)
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        engine.add_request(EngineRequest(rid, prompt[: context + i % 4], params))
    started: set[str] = set()
    while len(started) < batch:
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    for _ in range(2):
        engine.step()
    _sync(engine.config.device)
    start = time.perf_counter()
    num_tokens = 0
    for _ in range(num_steps):
        num_tokens += sum(len(o.new_token_ids) for o in engine.step())
    _sync(engine.config.device)
    seconds = time.perf_counter() - start

    graphed = engine.runner.last_step_graphed

    def profiled_steps() -> int:
        # Eager for the profiler (a replayed graph hides the model's ranges); restored after.
        graphs, engine.runner.graphs = engine.runner.graphs, None
        try:
            for _ in range(num_profiled):
                engine.step()
        finally:
            engine.runner.graphs = graphs
        return num_profiled

    breakdown = profile_steps(profiled_steps, engine.config.device)
    _drain(engine, ids)
    return Decode(batch, context, num_steps, num_tokens, seconds, breakdown, graphed)


def _time_to_first_token(engine: LLMEngine, rid: str, prompt: list[int]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    _sync(engine.config.device)
    start = time.perf_counter()
    engine.add_request(EngineRequest(rid, prompt, params))
    while not any(o.request_id == rid and o.new_token_ids for o in engine.step()):
        pass
    _sync(engine.config.device)
    return time.perf_counter() - start


def bench_prefill(engine: LLMEngine, prompt_len: int, repeats: int, seed: int) -> Prefill:
    """TTFT of a lone prompt of `prompt_len` tokens (fresh ones each time): a warm-up,
    `repeats` timed, one profiled."""
    vocab = engine.model.config.vocab_size
    prompts = _prompts(repeats + 2, prompt_len, vocab, seed)
    times = []
    for i in range(repeats + 1):
        ttft = _time_to_first_token(engine, f"prefill-{i}", prompts[i])
        _drain(engine, [])
        if i:
            times.append(ttft)

    def one_prefill() -> int:
        _time_to_first_token(engine, "prefill-profiled", prompts[-1])
        return 1

    breakdown = profile_steps(one_prefill, engine.config.device)
    _drain(engine, [])
    return Prefill(prompt_len, times, breakdown)


def prefill_transient_bytes(engine: LLMEngine, prompt_len: int) -> int:
    """What one prompt's step needs beyond the weights and the pool, about: the batched
    attention's row chunks (a few tensors of GATHER_BUDGET elements, float32 at most: the
    keys, their scores, the indexer's scores) and the step's activations (the mHC
    streams and a dozen hidden-wide rows per token, float32 at most)."""
    config = engine.model.config
    p = config.deepseek_v4
    assert p is not None
    per_token = (p.hc_mult + 12) * config.hidden_size * 4
    return 4 * GATHER_BUDGET * 4 + prompt_len * per_token


def largest_prefill_that_fits(engine: LLMEngine, prompt_len: int, margin: int = 4 << 30) -> int:
    """``prompt_len``, halved until its step's transients fit the GPU's free memory
    (with ``margin`` for everything else); unchanged off CUDA."""
    if not engine.config.device.startswith("cuda"):
        return prompt_len
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info(engine.config.device)[0]
    while prompt_len > 1024 and prefill_transient_bytes(engine, prompt_len) + margin > free:
        prompt_len //= 2
    return prompt_len


def build_engine(model: str, device: str, dtype: str, batches: list[int], context: int, max_new_tokens: int,
                 prompt_len: int, cuda_graphs: bool) -> LLMEngine:  # fmt: skip
    """The engine over the checkpoint: a KV pool for the largest decode batch or the
    long prompt, one step's budget the long prompt (or a decode prompt, if longer), no
    prefix cache or host tiers (every prompt is new)."""
    from shared.model.config import ModelConfig
    from shared.model.models import build_model

    decode_len = context + 3 + max_new_tokens + 8
    max_model_len = max(decode_len, prompt_len) + 16
    layout = build_model(ModelConfig.from_pretrained(model), device="meta").kv_layout
    block_size = 16
    num_blocks = max(
        max(batches) * blocks_for_one_request(layout, decode_len, block_size),
        blocks_for_one_request(layout, max_model_len, block_size),
    )
    budget = max(prompt_len, context + 3)
    config = EngineConfig(
        model=model, dtype=dtype, device=device, block_size=block_size, num_kv_blocks=num_blocks,
        max_num_seqs=max(batches), max_num_batched_tokens=budget, prefill_chunk_size=budget,
        max_model_len=max_model_len, enable_prefix_caching=False, cuda_graphs=cuda_graphs,
        host_kv_cache_bytes=0, state_cache_bytes=0,
    )  # fmt: skip
    return LLMEngine(config, detokenize=False)


def run_v4_bench(
    model: str,
    out_dir: str | None,
    device: str = "cuda",
    dtype: str = "bfloat16",
    batches: tuple[int, ...] = (1, 64),
    context: int = 1024,
    num_steps: int = 32,
    prompt_len: int = 8192,
    repeats: int = 2,
    cuda_graphs: bool = True,
    seed: int = 0,
    num_profiled: int | None = None,
) -> dict:
    start = time.perf_counter()
    max_new_tokens = num_steps + (num_profiled or 4) + 8  # bench_decode's requests' max_tokens, at most
    engine = build_engine(model, device, dtype, list(batches), context, max_new_tokens, prompt_len, cuda_graphs)
    load_s = time.perf_counter() - start
    figures = model_figures(engine)
    graphed = engine.runner.graphs is not None
    mode = "CUDA graphs" if graphed else (
        "eager" + (" (CUDA graphs asked for: none captured)" if cuda_graphs and device.startswith("cuda") else "")
    )  # fmt: skip
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    print(f"{model} on {where}, {dtype}, {mode}; loaded in {load_s:.1f} s", flush=True)
    print(f"params {figures['params'] / 1e9:.2f}B, active per token {figures['active_params'] / 1e9:.2f}B", flush=True)
    vocab = engine.model.config.vocab_size
    _time_to_first_token(engine, "warm-up", _prompts(1, 32, vocab, seed)[0])
    _drain(engine, [])
    peaks: dict[str, float] = {}
    decodes = []
    for batch in batches:
        _reset_peak(device)
        decodes.append(bench_decode(engine, batch, context, num_steps, seed + batch, num_profiled))
        peaks[f"decode b={batch}"] = _peak_gib(device)
        d = decodes[-1]
        print(f"decode b={batch} ctx~{context}: {d.tok_s:.1f} tok/s, {d.step_ms:.1f} ms/step"
              f"{' (graphed)' if d.graphed else ' (eager)'}", flush=True)  # fmt: skip
    fits = largest_prefill_that_fits(engine, prompt_len)
    if fits != prompt_len:
        print(f"prefill {prompt_len}: its attention's transients (~{prefill_transient_bytes(engine, prompt_len) / 2**30:.0f}"
              f" GiB) exceed the free memory; running {fits} instead", flush=True)  # fmt: skip
    _reset_peak(device)
    prefill = bench_prefill(engine, fits, repeats, seed + 1000)
    peaks[f"prefill {fits}"] = _peak_gib(device)
    print(f"prefill {fits}: TTFT {prefill.median_ttft_s * 1e3:.0f} ms, {prefill.tok_s:.0f} tok/s", flush=True)
    # Whether the timed decode steps replayed graphs (the prefill's step is never graphed).
    ran_graphs = any(d.graphed for d in decodes)
    engine.close()
    record = {
        "model": model, "device": where, "dtype": dtype, "mode": mode, "graphs_replayed": ran_graphs,
        "load_s": load_s, "torch": torch.__version__, "figures": figures, "peak_gib": peaks,
        "decode": [asdict(d) | {"tok_s": d.tok_s, "step_ms": d.step_ms} for d in decodes],
        "prefill": asdict(prefill) | {"tok_s": prefill.tok_s, "median_ttft_s": prefill.median_ttft_s,
                                      "prompt_len_asked": prompt_len},
    }  # fmt: skip
    table = render(record, decodes, prefill)
    print(table, flush=True)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        header = run_header()
        write_json(out / "v4_bench.json", record, header)
        write_text(out / "v4_bench.md", table, header)
    return record


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: str) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.startswith("cuda") else 0.0


def render(record: dict, decodes: list[Decode], prefill: Prefill) -> str:
    f = record["figures"]
    lines = [
        f"DeepSeek-V4 {record['model']} on {record['device']}, {record['dtype']}, {record['mode']}",
        "",
        f"params {f['params'] / 1e9:.2f}B, active per token {f['active_params'] / 1e9:.2f}B; KV per raw token: "
        f"{f['kv_logical_bytes_per_token']:.0f} B persisted (compressed entries + indexer keys), "
        f"{f['kv_pool_bytes_per_token']:.0f} B of the engine's pool (each group its own rows; a compressed cache keeps a row per raw token); "
        f"sliding state {f['kv_state_bytes_per_request'] / 2**20:.1f} MiB per request",
        "",
        "| figure | tok/s | per step / TTFT |",
        "|---|---|---|",
    ]
    for d in decodes:
        how = "graphed" if d.graphed else "eager"
        lines.append(f"| decode, batch {d.batch}, context ~{d.context} ({how}) | {d.tok_s:.1f} | {d.step_ms:.1f} ms |")
    lines.append(f"| prefill, one {prefill.prompt_len}-token prompt | {prefill.tok_s:.0f} | "
                 f"{prefill.median_ttft_s * 1e3:.0f} ms |")  # fmt: skip
    columns = [(f"decode b={d.batch}", d.breakdown, d.step_ms) for d in decodes]
    columns.append((f"prefill {prefill.prompt_len}", prefill.breakdown, prefill.median_ttft_s * 1e3))
    gpu = all(b.device_ms is not None for _, b, _ in columns)
    header = [f"{name}: {'GPU ms | host ms' if gpu else 'host ms'}" for name, _, _ in columns]
    lines += ["", "Per step (the prefill: the whole prompt), ms; profiled decode steps run eagerly:", "", "| kind | " + " | ".join(header) + " |",
              "|---|" + "---|" * (len(columns) * (2 if gpu else 1))]  # fmt: skip
    for key in [*KINDS, OUTSIDE]:
        label = KINDS.get(key, key)
        cells = [_cells(b, key, gpu) for _, b, _ in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    totals = [(f"{b.device_total_ms:.2f} | " if gpu else "") + f"{b.host_total_ms:.2f}" for _, b, _ in columns]
    lines.append("| total (kernels; profiled wall) | " + " | ".join(totals) + " |")
    walls = [(f"{wall:.2f} | " if gpu else "") + f"{wall:.2f}" for _, _, wall in columns]
    lines.append("| wall time, not profiled | " + " | ".join(walls) + " |")
    if gpu:
        busy = [f"{b.device_total_ms / wall:.0%} | " for _, b, wall in columns]
        lines.append("| GPU busy (kernels / wall) | " + " | ".join(busy) + " |")
    return "\n".join(lines)


def _cells(b: Breakdown, key: str, gpu: bool) -> str:
    host = f"{b.host_ms[key]:.2f}"
    return f"{b.device_ms[key]:.2f} | {host}" if gpu and b.device_ms is not None else host


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a V4 checkpoint folder (drawn there first with --preset)")
    parser.add_argument("--preset", default=None, help="make-model preset to draw into --model if it holds no checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batches", default="1,64", help="decode batch sizes, comma separated")
    parser.add_argument("--context", type=int, default=1024, help="decode prompts' length (staggered by 0-3)")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=8192, help="the long prompt's tokens")
    parser.add_argument("--repeats", type=int, default=2, help="timed prefills after the warm-up")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", default=None, help="folder for v4_bench.md and v4_bench.json")
    args = parser.parse_args(argv)
    folder = Path(args.model)
    # make_model writes config.json first and the shards' index last: a draw cut short has no index.
    if not (folder / "config.json").is_file() or not any((folder / f).is_file() for f in (SINGLE_FILE, INDEX_FILE)):
        if args.preset is None:
            parser.error(f"{args.model} holds no checkpoint: give --preset to draw one there")
        from tools.make_model import make_model

        start = time.perf_counter()
        num = make_model(args.model, arch="deepseek_v4", seed=args.seed, preset=args.preset,
                         dtype=getattr(torch, args.dtype), device=args.device, tokenizer=False)  # fmt: skip
        print(f"drew {args.preset} ({num:,} params) into {args.model} in {time.perf_counter() - start:.1f} s", flush=True)
    run_v4_bench(
        args.model, args.out, args.device, args.dtype, tuple(int(b) for b in args.batches.split(",")), args.context,
        args.decode_steps, args.prefill, args.repeats, args.cuda_graphs, args.seed,
    )  # fmt: skip


if __name__ == "__main__":
    main()
