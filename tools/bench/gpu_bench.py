"""`infermesh bench-gpu`: the engine on a GPU against the card's own limits and
against transformers, all measured in one run.

The model is Llama-3-8B's shape with seeded random weights in bfloat16, built
in GPU memory (no file, no download); transformers gets the very same tensors.
The card's copy bandwidth and bf16 matmul rate are measured first, and each
row is reported as a fraction of its roofline:
- decode: (weight bytes + KV bytes read per step) / bandwidth per step;
- prefill: FLOPs / matmul rate.
Decode rows time the engine's model runner on decode-only steps over a paged
cache already holding `context` tokens per sequence (building that context by
prefill would cost minutes of device time and measure prefill, not decode),
stepped as the engine steps with async scheduling (launch N+1, then read N).
"""

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from shared.engine.engine_request import EngineRequest
from shared.engine.model_runner import ModelRunner, StepHandle
from shared.engine.sampling_params import SamplingParams
from shared.engine.step import PLACEHOLDER, NewRequestData, ScheduledChunk, SchedulerOutput
from shared.model.config import ModelConfig
from shared.model.loader import load_weights
from tools.make_model import PRESETS, hf_config_dict
from shared.model.interface import CausalLM
from shared.model.models import build_model
from tools.bench.raw_file import run_header, write_json, write_text


@dataclass
class Row:
    kind: str  # decode | prefill
    batch: int
    context: int
    tok_s: float
    roofline_tok_s: float
    hf_tok_s: float | None = None
    eager_tok_s: float | None = None
    """Decode without CUDA graphs, for the graphs' share of the speed."""
    note: str = ""

    @property
    def fraction(self) -> float:
        return self.tok_s / self.roofline_tok_s

    @property
    def vs_hf(self) -> float | None:
        return self.tok_s / self.hf_tok_s if self.hf_tok_s else None


def _time(fn, warmup: int = 2, iters: int = 10) -> float:  # noqa: ANN001
    """Seconds per call, CUDA events around `iters` back-to-back calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def measure_card() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s) on random data."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()  # 1 GiB
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / _time(lambda: dst.copy_(src), iters=20)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    rate = 2 * 8192**3 / _time(lambda: a @ b, iters=10)
    return bw, rate


def build_models(seed: int, with_hf: bool):  # noqa: ANN201
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg_dict = hf_config_dict("llama", PRESETS["llama3-8b"], "bfloat16", 128000, 128001)
    config = ModelConfig.from_dict(cfg_dict)
    torch.manual_seed(seed)
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "transformers_version")})
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            hf = LlamaForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    ours = build_model(config, torch.bfloat16, "cuda")
    load_weights(ours, hf.state_dict())
    if not with_hf:
        del hf
        hf = None
    return config, ours, hf


def weight_bytes(model: CausalLM) -> int:
    """Bytes a decode step reads: every parameter but the embedding table (a lookup reads B rows)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)


def kv_bytes_per_token(config: ModelConfig) -> int:
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2


def bench_decode(model: CausalLM, config: ModelConfig, batch: int, context: int, steps: int = 32,
                 block_size: int = 16, graphs: bool = True) -> float:
    """Decode tokens/s of the model runner: `batch` sequences holding `context` tokens each.

    Stepped as the engine does with async scheduling: step N+1 is launched (its input
    tokens placeholders that the device fills from step N's samples) before step N's
    tokens are read back, so the host's work overlaps the device's."""
    blocks_per_seq = -(-(context + steps + 8) // block_size)
    runner = ModelRunner(
        model, batch * blocks_per_seq, block_size, torch.bfloat16, torch.device("cuda"),
        cuda_graphs=graphs, max_model_len=blocks_per_seq * block_size, max_batch=batch,
    )
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    new = [NewRequestData(str(i), [1] * context, params, frozenset(), []) for i in range(batch)]
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    pos = [context]

    def launch() -> StepHandle:
        first = pos[0] == context
        sched = SchedulerOutput(new_requests=new if first else [])
        token = 7 if first else PLACEHOLDER
        sched.chunks = [ScheduledChunk(str(i), [token], pos[0], [tables[i]], True) for i in range(batch)]
        pos[0] += 1
        return runner.launch(sched)

    handle = launch()  # warm-up (and graph capture), and the runner learns the requests
    for _ in range(3):
        handle, previous = launch(), handle
        runner.collect(previous)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        handle, previous = launch(), handle
        runner.collect(previous)
    runner.collect(handle)
    elapsed = time.perf_counter() - t0
    del runner
    torch.cuda.empty_cache()
    return batch * steps / elapsed


def prefill_flops(config: ModelConfig, wbytes: int, prompt_len: int) -> float:
    """The work a prefill must do: every layer's matmuls for every token, causal
    attention, and the logits of the last token only (as transformers' logits_to_keep=1)."""
    lm_head = config.vocab_size * config.hidden_size
    layer_params = wbytes // 2 - lm_head
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * prompt_len * (prompt_len + 1) / 2
    return 2 * layer_params * prompt_len + 2 * lm_head + attention


def bench_prefill(model: CausalLM, prompt_len: int, block_size: int = 16) -> float:
    blocks = -(-prompt_len // block_size)
    runner = ModelRunner(model, blocks + 1, block_size, torch.bfloat16, torch.device("cuda"))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    ids = torch.randint(0, 100000, (prompt_len,)).tolist()

    def step() -> None:
        sched = SchedulerOutput(new_requests=[NewRequestData("p", ids, params, frozenset(), [])])
        sched.chunks = [ScheduledChunk("p", ids, 0, [list(range(blocks))], True)]
        runner.execute(sched)

    seconds = _time(step, warmup=1, iters=3)
    del runner
    torch.cuda.empty_cache()
    return prompt_len / seconds


def hf_decode(hf, batch: int, context: int, steps: int = 16) -> float:  # noqa: ANN001
    """transformers' decode tokens/s: generate with a static cache, each step's end
    stamped by a logits processor (after a device sync), so the prefill is left out
    without subtracting two runs. ``disable_compile``: with a static cache on CUDA,
    transformers compiles its forward on its own, per shape, which would time the
    compiler in some rows and not others."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            torch.cuda.synchronize()
            self.stamps.append(time.perf_counter())
            return scores

    ids = torch.randint(0, 100000, (batch, context), device="cuda")
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0, attention_mask=torch.ones_like(ids),
              disable_compile=True, max_new_tokens=steps + 1, min_new_tokens=steps + 1)  # fmt: skip
    with torch.inference_mode():
        hf.generate(ids, **kw)  # warm-up at the timed shapes
        clock = StepClock()
        hf.generate(ids, logits_processor=LogitsProcessorList([clock]), **kw)
    torch.cuda.empty_cache()
    # Stamp 0 ends the prefill; each later one ends a decode step.
    return batch * (len(clock.stamps) - 1) / (clock.stamps[-1] - clock.stamps[0])


def hf_prefill(hf, prompt_len: int) -> float:  # noqa: ANN001
    ids = torch.randint(0, 100000, (1, prompt_len), device="cuda")
    with torch.inference_mode():
        seconds = _time(lambda: hf(ids, logits_to_keep=1), warmup=1, iters=3)
    torch.cuda.empty_cache()
    return prompt_len / seconds


# -- the whole engine (scheduler, runner, sampler, step loop) ---------------------------

ENGINE_OUTPUT_LEN = 128


def _engine(model: CausalLM, **knobs) -> "LLMEngine":  # noqa: ANN003
    """The engine as a service builds it on this card, with its default step sizes
    unless knobs say otherwise; 16 GiB of KV (64 requests of 1k + 128 tokens fit, so
    nothing is preempted), no prefix cache (every prompt is new)."""
    from shared.engine.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model="(in memory)", dtype="bfloat16", device="cuda", kv_cache_memory_bytes=16 << 30,
        enable_prefix_caching=False, **knobs,
    )
    return LLMEngine(config, model=model, detokenize=False)


def _prompt(length: int) -> list[int]:
    return torch.randint(10, 100000, (length,)).tolist()


def engine_prefill(model: CausalLM, prompt_len: int, budget: int | None, chunk: int | None, repeats: int = 3) -> float:
    """Median seconds from add_request to the first token of a lone `prompt_len` prompt."""
    engine = _engine(model, max_num_batched_tokens=budget, prefill_chunk_size=chunk)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i in range(repeats + 1):  # the first warms up
        start = time.perf_counter()
        engine.add_request(EngineRequest(f"p{i}", _prompt(prompt_len), params))
        while not any(out.new_token_ids for out in engine.step()):
            pass
        times.append(time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
    engine.close()
    del engine
    torch.cuda.empty_cache()
    return sorted(times[1:])[len(times[1:]) // 2]


def engine_decode(model: CausalLM, batch: int, context: int, logprobs: int | None) -> float:
    """Output tokens/s of `batch` requests of `context`-token prompts decoding together,
    from the step that gave every one its first token to the last (a warm-up round first)."""
    engine = _engine(model, max_num_seqs=max(batch, 1))
    params = SamplingParams(max_tokens=ENGINE_OUTPUT_LEN, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    rate = 0.0
    for rnd in range(2):
        for i in range(batch):
            engine.add_request(EngineRequest(f"d{rnd}-{i}", _prompt(context), params))
        counts: dict[str, int] = {}
        start = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
            if start is None and len(counts) == batch and all(counts.values()):
                start, at_start = time.perf_counter(), sum(counts.values())
        rate = (sum(counts.values()) - at_start) / (time.perf_counter() - start)
    engine.close()
    del engine
    torch.cuda.empty_cache()
    return rate


def engine_mixed(model: CausalLM, prompt_len: int, num_decoding: int = 8) -> dict[str, float]:
    """A `prompt_len` prompt arriving while `num_decoding` requests decode, at the default
    step sizes: its TTFT, and the decoding requests' inter-token latency meanwhile
    (the gap between consecutive steps that gave them a token)."""
    engine = _engine(model)
    long = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    for i in range(num_decoding):
        engine.add_request(EngineRequest(f"bg{i}", _prompt(128), long))
    for _ in range(40):  # well into decoding, graphs captured
        engine.step()
    engine.step()
    last = time.perf_counter()
    gaps: list[float] = []
    start = time.perf_counter()
    engine.add_request(EngineRequest("long", _prompt(prompt_len), SamplingParams(max_tokens=1, temperature=0.0)))
    ttft = None
    while ttft is None:
        outs = engine.step()
        now = time.perf_counter()
        if any(o.request_id == "bg0" and o.new_token_ids for o in outs):
            gaps.append(now - last)
            last = now
        if any(o.request_id == "long" and o.new_token_ids for o in outs):
            ttft = now - start
    for i in range(num_decoding):
        engine.abort_request(f"bg{i}")
    engine.close()
    del engine
    torch.cuda.empty_cache()
    gaps_ms = sorted(g * 1e3 for g in gaps)
    return {"ttft_s": ttft, "num_decoding": num_decoding, "itl_p50_ms": gaps_ms[len(gaps_ms) // 2],
            "itl_max_ms": gaps_ms[-1]}


@dataclass(slots=True)
class RowSpec:
    """Which rows to run: the runner alone (decode, prefill) and the whole engine."""

    decode: list[tuple[int, int]] = field(default_factory=list)
    """(batch, context)"""
    prefill: list[int] = field(default_factory=list)
    """prompt tokens"""
    engine_decode: list[tuple[int, int]] = field(default_factory=list)
    engine_prefill: list[int] = field(default_factory=list)


DEFAULT_ROWS = RowSpec(
    decode=[(b, c) for c in (1024, 8192) for b in (1, 8, 64, 256)],
    prefill=[1024, 8192],
    engine_decode=[(1, 1024), (64, 1024)],
    engine_prefill=[8192],
)


def parse_rows(spec: str) -> RowSpec:
    """``"decode:1x1024,prefill:8192,engine-decode:1x1024,engine-prefill:8192"`` -> a RowSpec."""
    rows = RowSpec()
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, _, shape = item.partition(":")
        try:
            if kind in ("decode", "engine-decode"):
                batch, context = shape.split("x")
                (rows.decode if kind == "decode" else rows.engine_decode).append((int(batch), int(context)))
            elif kind in ("prefill", "engine-prefill"):
                (rows.prefill if kind == "prefill" else rows.engine_prefill).append(int(shape))
            else:
                raise ValueError(kind)
        except ValueError:
            raise ValueError(
                f"bad row {item!r}: expected [engine-]decode:BATCHxCONTEXT or [engine-]prefill:TOKENS"
            ) from None
    return rows


def run_gpu_bench(out_dir: str, hf_rows: bool = True, seed: int = 0, spec: RowSpec = DEFAULT_ROWS) -> list[Row]:
    bw, rate = measure_card()
    print(f"card: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    config, model, hf = build_models(seed, hf_rows)
    wbytes = weight_bytes(model)
    kv_tok = kv_bytes_per_token(config)
    free = torch.cuda.mem_get_info()[0]
    rows: list[Row] = []
    for batch, context in spec.decode:
        need = batch * (context + 32) * kv_tok
        roof = batch / ((wbytes + batch * context * kv_tok) / bw)
        if need > free * 0.8:
            rows.append(Row("decode", batch, context, float("nan"), roof, note=f"KV {need / 2**30:.0f} GiB does not fit"))
            print(f"decode b={batch} ctx={context}: skipped, KV does not fit", flush=True)
            continue
        ours = bench_decode(model, config, batch, context)
        eager = bench_decode(model, config, batch, context, graphs=False)
        # transformers must prefill the context itself: keep its rows to <= 256k tokens of device time.
        theirs = hf_decode(hf, batch, context) if hf is not None and batch * context <= 262144 else None
        rows.append(Row("decode", batch, context, ours, roof, theirs, eager))
        print(f"decode b={batch} ctx={context}: {ours:.0f} tok/s ({ours / roof:.2f} of roofline), eager {eager:.0f}"
              + (f", transformers {theirs:.0f}" if theirs else ""), flush=True)
    for prompt_len in spec.prefill:
        roof = prompt_len / (prefill_flops(config, wbytes, prompt_len) / rate)
        ours = bench_prefill(model, prompt_len)
        theirs = hf_prefill(hf, prompt_len) if hf is not None else None
        rows.append(Row("prefill", 1, prompt_len, ours, roof, theirs))
        print(f"prefill {prompt_len}: {ours:.0f} tok/s ({ours / roof:.2f} of roofline)"
              + (f", transformers {theirs:.0f}" if theirs else ""), flush=True)
    if spec.engine_decode or spec.engine_prefill:
        del hf
        torch.cuda.empty_cache()
    for batch, context in spec.engine_decode:
        roof = batch / ((wbytes + batch * (context + ENGINE_OUTPUT_LEN // 2) * kv_tok) / bw)
        for logprobs in (None, 0):
            ours = engine_decode(model, batch, context, logprobs)
            note = "whole engine" + (", logprobs=0" if logprobs is not None else "")
            rows.append(Row("decode", batch, context, ours, roof, note=note))
            print(f"engine decode b={batch} ctx={context} ({note}): {ours:.0f} tok/s ({ours / roof:.2f} of roofline)",
                  flush=True)
    for prompt_len in spec.engine_prefill:
        roof = prompt_len / (prefill_flops(config, wbytes, prompt_len) / rate)
        for sizes in ((None, None), (512, 512)):
            budget, chunk = sizes
            ttft = engine_prefill(model, prompt_len, budget, chunk)
            note = "whole engine, default step sizes" if budget is None else f"whole engine, step budget {budget}"
            rows.append(Row("prefill", 1, prompt_len, prompt_len / ttft, roof, note=f"{note}, TTFT {ttft * 1e3:.0f} ms"))
            print(f"engine prefill {prompt_len} ({note}): TTFT {ttft * 1e3:.0f} ms, "
                  f"{prompt_len / ttft / roof:.2f} of roofline", flush=True)
        mixed = engine_mixed(model, prompt_len)
        rows.append(Row("prefill", 1, prompt_len, prompt_len / mixed["ttft_s"], roof, note=(
            f"whole engine, while {mixed['num_decoding']} requests decode: their inter-token latency "
            f"p50 {mixed['itl_p50_ms']:.1f} ms, max {mixed['itl_max_ms']:.1f} ms; TTFT {mixed['ttft_s'] * 1e3:.0f} ms"
        )))
        print(f"engine prefill {prompt_len} while decoding: {rows[-1].note}", flush=True)
    table = render(rows, bw, rate)
    print(table)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_bytes_per_s": bw,
        "bf16_flop_per_s": rate,
        "rows": [asdict(r) | {"fraction": r.fraction, "vs_hf": r.vs_hf} for r in rows],
    }
    header = run_header()
    write_json(out / "gpu_bench.json", record, header)
    write_text(out / "gpu_bench.md", table, header)
    return rows


def render(rows: list[Row], bw: float, rate: float) -> str:
    lines = [
        f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s (measured in this run)",
        "",
        "| kind | batch | context | tok/s | roofline tok/s | of roofline | without CUDA graphs | transformers tok/s | vs transformers | what |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hf = f"{r.hf_tok_s:.0f}" if r.hf_tok_s else "-"
        vs = f"{r.vs_hf:.2f}" if r.vs_hf else "-"
        tok = f"{r.tok_s:.0f}" if r.tok_s == r.tok_s else r.note
        frac = f"{r.fraction:.2f}" if r.tok_s == r.tok_s else "-"
        eager = f"{r.eager_tok_s:.0f}" if r.eager_tok_s else "-"
        what = r.note if r.tok_s == r.tok_s and r.note else "model runner"
        lines.append(f"| {r.kind} | {r.batch} | {r.context} | {tok} | {r.roofline_tok_s:.0f} | {frac} | {eager} | {hf} | {vs} | {what} |")
    return "\n".join(lines)


def bench_overlap(model: CausalLM, batch: int, prompt_len: int = 128, output_len: int = 64) -> dict[str, float]:
    """The whole engine (scheduler, runner, sampler) decoding `batch` requests,
    step by step against overlapped (async scheduling), with the GPU's own time
    per step (the decode graph, the logits and the greedy pick, back to back) to
    show the idle gap."""
    from shared.engine.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine

    figures: dict[str, float] = {}
    for mode in ("sync", "async"):
        engine = LLMEngine(
            EngineConfig(
                model="(in memory)", dtype="bfloat16", device="cuda", max_num_seqs=batch,
                num_kv_blocks=batch * (-(-(prompt_len + output_len) // 16) + 1), max_model_len=prompt_len + output_len + 16,
                async_scheduling=mode == "async", enable_prefix_caching=False,
            ),
            model=model,
        )
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        for rnd in range(2):  # the first round captures graphs and compiles
            for i in range(batch):
                engine.add_request(EngineRequest(f"{mode}{rnd}-{i}", torch.randint(0, 100000, (prompt_len,)).tolist(), params))
            first = None
            num_steps = 0
            while engine.has_unfinished_requests():
                outs = engine.step()
                if first is None and outs and all(len(o.token_ids) >= 1 for o in outs) and len(outs) == batch:
                    torch.cuda.synchronize()
                    first = time.perf_counter()
                    num_steps = 0
                num_steps += 1
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - (first or time.perf_counter())
        figures[f"{mode}_step_ms"] = elapsed / max(num_steps - 1, 1) * 1e3
        figures[f"{mode}_tok_s"] = batch * (output_len - 1) / elapsed
        graphs = engine.runner.graphs
        if graphs is not None and mode == "sync":
            graph, hidden = graphs._graphs[graphs._bucket(batch)]

            def device_step() -> None:
                # What the device runs per step: the decode graph, then the logits and
                # the greedy pick, which stay outside the graph.
                graph.replay()  # noqa: B023
                engine.runner.model.compute_logits(hidden[:batch]).argmax(dim=-1)  # noqa: B023

            figures["gpu_step_ms"] = _time(device_step, warmup=2, iters=20) * 1e3
        del engine
        torch.cuda.empty_cache()
    return figures


def run_overlap_bench(out_dir: str, seed: int = 0) -> dict[int, dict[str, float]]:
    _, model, _ = build_models(seed, with_hf=False)
    results = {}
    lines = ["| batch | GPU time per step (graph, logits, argmax) | step, step by step | idle gap | step, overlapped | idle gap | tok/s step by step | tok/s overlapped |",
             "|---|---|---|---|---|---|---|---|"]
    for batch in (1, 8, 64):
        f = bench_overlap(model, batch)
        results[batch] = f
        gpu = f.get("gpu_step_ms", float("nan"))
        lines.append(
            f"| {batch} | {gpu:.2f} ms | {f['sync_step_ms']:.2f} ms | {f['sync_step_ms'] - gpu:.2f} ms | "
            f"{f['async_step_ms']:.2f} ms | {f['async_step_ms'] - gpu:.2f} ms | {f['sync_tok_s']:.0f} | {f['async_tok_s']:.0f} |"
        )
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    header = run_header()
    write_json(out / "overlap.json", {str(batch): f for batch, f in results.items()}, header)
    write_text(out / "overlap.md", table, header)
    return results
