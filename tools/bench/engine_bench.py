"""`infermesh bench-engine`: prefill and decode throughput of the engine and of
`transformers` on the same checkpoint and prompts, measured side by side in
one run so that the ratio holds on a noisy machine."""

import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shared.engine.engine_request import EngineRequest
from shared.engine.config import EngineConfig
from shared.engine.dtypes import torch_dtype
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class Figures:
    prefill_tok_s: float
    decode_tok_s: float


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    # Distinct random prompts: no prefix-cache hits flatter the engine.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, prompt_len), generator=g).tolist()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_infermesh(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> Figures:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    tag = str(time.monotonic_ns())
    device = engine.config.device
    _sync(device)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"{tag}-{i}", p, params))
    first_token_at = None
    num_with_first = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if len(out.token_ids) == 1:
                num_with_first += 1
        if first_token_at is None and num_with_first == len(prompts):
            _sync(device)
            first_token_at = time.perf_counter()
    _sync(device)
    end = time.perf_counter()
    assert first_token_at is not None
    num_prompt = sum(len(p) for p in prompts)
    decode_tokens = len(prompts) * (output_len - 1)
    return Figures(num_prompt / (first_token_at - start), decode_tokens / max(end - first_token_at, 1e-9))


def bench_transformers(model, prompts: list[list[int]], output_len: int, device: str) -> Figures:  # noqa: ANN001
    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        _sync(device)
        start = time.perf_counter()
        model(ids)  # prefill of the whole batch: same work as the engine's first phase
        _sync(device)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
        )
        _sync(device)
        total = time.perf_counter() - start
    decode_tokens = len(prompts) * (output_len - 1)
    return Figures(ids.numel() / prefill, decode_tokens / max(total - prefill, 1e-9))


def run_engine_bench(
    model: str | None,
    batch_sizes: list[int],
    prompt_len: int,
    output_len: int,
    engine_flags: Mapping[str, Any] | None = None,
    compare_transformers: bool = True,
) -> list[dict[str, float]]:
    """engine_flags: EngineConfig fields over the benchmark's own choices (a batch
    of the largest size prefilled in one step, no prefix caching) and EngineConfig's defaults."""
    if output_len < 2:
        raise ValueError("output_len must be at least 2 to time decode")
    tmp = None
    if model is None:
        from tools.make_model import make_model

        tmp = tempfile.TemporaryDirectory()
        model = tmp.name
        make_model(model)
    own = dict(
        max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=max(batch_sizes) * prompt_len,
        prefill_chunk_size=prompt_len,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(EngineConfig(model=model, **{**own, **(engine_flags or {})}))
    device, dtype = engine.config.device, engine.config.dtype
    hf = None
    if compare_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype(dtype)).to(device).eval()
    vocab = engine.model.config.vocab_size
    # Warm up both sides once (allocator, lazy init) before timing.
    warm = _prompts(2, min(prompt_len, 16), vocab, seed=1)
    bench_infermesh(engine, warm, 2)
    if hf is not None:
        bench_transformers(hf, warm, 2, device)

    rows = []
    print(f"model={model} device={device} dtype={dtype} prompt_len={prompt_len} output_len={output_len}")
    header = f"{'batch':>5} | {'prefill tok/s':>13} {'hf':>9} {'ratio':>6} | {'decode tok/s':>12} {'hf':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for batch in batch_sizes:
        prompts = _prompts(batch, prompt_len, vocab, seed=batch)
        ours = bench_infermesh(engine, prompts, output_len)
        theirs = bench_transformers(hf, prompts, output_len, device) if hf is not None else None
        row = {"batch": batch, "prefill_tok_s": ours.prefill_tok_s, "decode_tok_s": ours.decode_tok_s}
        line = f"{batch:>5} | {ours.prefill_tok_s:>13.1f} "
        if theirs is not None:
            row |= {
                "hf_prefill_tok_s": theirs.prefill_tok_s,
                "hf_decode_tok_s": theirs.decode_tok_s,
                "prefill_ratio": ours.prefill_tok_s / theirs.prefill_tok_s,
                "decode_ratio": ours.decode_tok_s / theirs.decode_tok_s,
            }
            line += f"{theirs.prefill_tok_s:>9.1f} {row['prefill_ratio']:>6.2f} | "
            line += f"{ours.decode_tok_s:>12.1f} {theirs.decode_tok_s:>9.1f} {row['decode_ratio']:>6.2f}"
        else:
            line += f"{'-':>9} {'-':>6} | {ours.decode_tok_s:>12.1f} {'-':>9} {'-':>6}"
        print(line, flush=True)
        rows.append(row)
    if tmp is not None:
        tmp.cleanup()
    return rows
