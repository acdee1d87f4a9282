"""Tiny seeded transformers models saved in HF format: the reference our model is checked
against. Every parameter (biases and norm weights included) is re-drawn at random, so
a bias or norm we forgot to apply shows up as a logit mismatch."""

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Small dims that still exercise everything: several heads per kv head, several layers.
_COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

# Each entry: the transformers config class name and what the variant exercises.
ARCH_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama-3 rope scaling with a short original context, so all three frequency bands occur
    # (head_dim 16, theta 5e5: wavelengths 6.3 < 16, 16 < 32.6 < 64, 169 > 64).
    "llama3_rope": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            )
        ),
    ),
    # Plain multi-head attention, Llama's attention_bias (o_proj too) and mlp_bias.
    "llama_mha_bias": ("LlamaConfig", dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True)),
    # q/k/v biases, tied embeddings, hybrid layers: layer 0 full, layers 1-2 sliding.
    "qwen2": (
        "Qwen2Config",
        dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    # q/k norm, head_dim 24 != 64 / 4, MQA.
    "qwen3_mqa": ("Qwen3Config", dict(head_dim=24, num_key_value_heads=1)),
    # Sliding window 8 in every layer, GQA 4:2.
    "mistral": ("MistralConfig", dict(sliding_window=8)),
}


# The MoE families (tests/parity/test_moe_parity.py): several sparse/dense layer mixes, windows.
MOE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Layers 0 and 2 sparse, layer 1 dense (mlp_only_layers), renormalised top-2 of 8.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    ),
    # Only layer 1 sparse (decoder_sparse_step 2), top-3 not renormalised, a window on every layer.
    "qwen3_moe_step2": (
        "Qwen3MoeConfig",
        dict(
            num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, decoder_sparse_step=2,
            use_sliding_window=True, sliding_window=6, head_dim=24,
        ),
    ),
    # Sliding (0, 2) and full (1) layers, sinks, YaRN with a short original context so the
    # ramp bites, a swiglu limit low enough that the clamp bites.
    "gpt_oss": (
        "GptOssConfig",
        dict(
            num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=16, sliding_window=6,
            swiglu_limit=0.3, max_position_embeddings=128,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                original_max_position_embeddings=32, truncate=False,
            ),
        ),
    ),
}


def save_tiny_hf_model(arch: str, path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Build the tiny transformers model ``arch`` (a key of ARCH_VARIANTS or one of
    llama/qwen2/qwen3/mistral), randomise it with ``seed`` and ``save_pretrained`` it into
    ``path``. ``overrides`` go to the config, except ``max_shard_size`` which goes to
    ``save_pretrained``. Returns ``path``."""
    import transformers

    aliases = {"llama": "llama3_rope", "qwen3": "qwen3_mqa"}
    class_name, variant = {**ARCH_VARIANTS, **MOE_VARIANTS}[aliases.get(arch, arch)]
    max_shard_size = overrides.pop("max_shard_size", None)
    config = getattr(transformers, class_name)(**{**_COMMON, **variant, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            # Norm weights near 1, everything else like HF's init (std 0.02) but biases not zero.
            # Sinks near 1 in size, so that they take a real share of each softmax.
            scale = 1.0 if name.endswith("sinks") else 0.05
            param.copy_(1.0 + 0.1 * noise if "norm" in name else scale * noise)
    out = Path(path)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    return out


def hf_logits(path: str | Path, token_ids: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float32 logits [len, vocab] for each sequence, each run alone (no padding)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].float() for ids in token_ids]


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Seeded random token-id prompts of the given lengths (ids from 3 up: clear of special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(path: str | Path, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, each run alone (no padding to muddy the reference)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new, do_sample=False)
        outs.append(gen[0, len(p) :].tolist())
    return outs


# -- what the parity tests share: a case, its checks, and the CLI run -----------------------


@dataclass
class ParityCase:
    """A checkpoint, our model loaded from it, seeded prompts, each prompt followed by
    num_decode more tokens (full), and transformers' logits over each full sequence
    (causal: one forward gives the reference for every prefill and decode step)."""

    path: Path
    model: Any
    prompts: list[list[int]]
    full: list[list[int]]
    reference: list[torch.Tensor]


def parity_case(path: Path, prompt_lens: Sequence[int], num_decode: int, seed: int, low: int = 0,
                vocab: int | None = None) -> ParityCase:
    """Token ids drawn from [low, vocab) (vocab: the model's unless given)."""
    from shared.model.loader import load_model

    model = load_model(path)
    high = model.config.vocab_size if vocab is None else vocab
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(low, high, (n,), generator=g).tolist() for n in prompt_lens]
    full = [p + torch.randint(low, high, (num_decode,), generator=g).tolist() for p in prompts]
    return ParityCase(path, model, prompts, full, hf_logits(path, full))


def check_prefill_then_decode(case: ParityCase, driver: Any, num_decode: int, tolerance: float) -> None:
    """One varlen prefill of every prompt, then num_decode batched single-token steps,
    each within tolerance (tests.helpers.numerics.rel_err) of transformers' logits."""
    from tests.helpers.numerics import rel_err

    out = driver.step(dict(enumerate(case.prompts)))
    for s, prompt in enumerate(case.prompts):
        assert rel_err(out[s], case.reference[s][: len(prompt)]) < tolerance, f"prefill of sequence {s}"
    for k in range(num_decode):
        out = driver.step({s: [case.full[s][len(p) + k]] for s, p in enumerate(case.prompts)})
        for s, prompt in enumerate(case.prompts):
            pos = len(prompt) + k
            assert rel_err(out[s], case.reference[s][pos : pos + 1]) < tolerance, f"decode step {k}, sequence {s}"


def check_chunked_prefill_beside_decode(
    case: ParityCase, driver: Any, chunks: Sequence[tuple[int, int]], tolerance: float
) -> None:
    """Sequence 2 prefilled in the given chunks; sequence 0 prefilled in the first step
    and decoding one token beside each later chunk."""
    from tests.helpers.numerics import rel_err

    long, short = case.full[2], case.full[0]
    for step, (a, b) in enumerate(chunks):
        short_pos = len(case.prompts[0]) + step - 1
        short_new = short[: short_pos + 1] if step == 0 else [short[short_pos]]
        out = driver.step({2: long[a:b], 0: short_new})
        assert rel_err(out[2], case.reference[2][a:b]) < tolerance, f"chunk {step}"
        ref_short = case.reference[0][short_pos + 1 - len(short_new) : short_pos + 1]
        assert rel_err(out[0], ref_short) < tolerance, f"short sequence at step {step}"


def check_greedy_then_prefix_hit(llm: Any, path: str | Path, prompts: list[list[int]], hit: list[int],
                                 num_hit_tokens: int, num_new: int) -> None:
    """The engine's greedy num_new tokens of prompts (batched), then of hit alone (which
    shares num_hit_tokens with an earlier prompt: a prefix hit), equal transformers' generate."""
    from shared.engine.sampling_params import SamplingParams

    expected = hf_greedy(path, prompts + [hit], num_new)
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected[:-1]
    (again,) = llm.generate([hit], params)
    assert again.num_cached_tokens == num_hit_tokens
    assert again.token_ids == expected[-1]


def infermesh(*args: str) -> subprocess.CompletedProcess:
    """The CLI as a user runs it."""
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], capture_output=True, text=True)


def make_model_cli(path: Path, arch: str, *extra: str) -> dict[str, Any]:
    """`infermesh make-model PATH --arch ARCH --seed 2 ...`; returns the config.json it wrote."""
    made = infermesh("make-model", str(path), "--arch", arch, "--seed", "2", *extra)
    assert made.returncode == 0, made.stderr
    return json.loads((path / "config.json").read_text())


def check_cli_generate_equals_hf(
    path: Path, prompts: list[list[int]], max_tokens: int, *extra: str
) -> list[dict[str, Any]]:
    """`infermesh generate --json --prompt-ids ...` on path: each record's prompt and
    tokens equal the prompt and transformers' greedy continuation. Returns the records."""
    expected = hf_greedy(path, prompts, max_tokens)
    args = ["generate", "--model", str(path), "--max-tokens", str(max_tokens), "--json", *extra]
    for p in prompts:
        args += ["--prompt-ids", " ".join(map(str, p))]
    out = infermesh(*args)
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["prompt_token_ids"] for r in records] == prompts
    assert [r["token_ids"] for r in records] == expected
    return records
