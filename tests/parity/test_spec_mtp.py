"""The MTP drafter (issue 13): a DeepSeek-layout MTP layer over a Llama target
(shared/model/mtp.py) equals a direct reimplementation, loads from checkpoints that
carry it (and refuses those that do not), drafts what a full recomputation drafts at
every step of the engine, keeps greedy output identical to no speculation, and on the
trained default target is accepted on Python."""

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import shared.engine.spec.speculator as speculator_module
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.engine.spec.mtp_drafter import MtpDrafter
from shared.model.forward_batch import AttentionMetadata
from shared.model.loader import load_model
from shared.model.mtp import MtpLayer, load_mtp, save_mtp
from tests.helpers.hf_models import hf_logits, random_prompts, save_tiny_hf_model

TRAINED = Path(__file__).resolve().parents[2] / "models" / "trained" / "target"
SMALL = dict(block_size=4, prefill_chunk_size=8, max_num_batched_tokens=24)
"""Prompts span blocks, prefill is chunked, decode steps mix with prefill chunks."""


def random_mtp_tensors(folder: Path, seed: int) -> dict[str, torch.Tensor]:
    """Seeded MTP weights for the checkpoint in folder: norms near 1 (each different, so a
    swapped or missing norm shows), the rest like the tiny models' (std 0.05)."""
    layer = MtpLayer(load_model(folder))
    g = torch.Generator().manual_seed(seed)
    return {
        name: (1.0 + 0.2 * torch.randn(t.shape, generator=g)) if "norm" in name else 0.05 * torch.randn(t.shape, generator=g)
        for name, t in sorted(layer.checkpoint_tensors().items())
    }


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return save_tiny_hf_model("llama", tmp_path_factory.mktemp("mtp-plain"))


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory) -> Path:
    path = save_tiny_hf_model("llama", tmp_path_factory.mktemp("mtp-target"))
    save_mtp(path, random_mtp_tensors(path, seed=7))
    return path


def reference_mtp(
    folder: Path, hidden: torch.Tensor, next_ids: list[int], swap: bool = False, hnorm: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs [T, H], logits [T, vocab]) of the MTP layer over one sequence, from the
    checkpoint's tensors: plain torch for the norms, the concat and the head, and
    transformers' Llama decoder layer (causal, rope from position 0) for the block.
    swap / hnorm=False: the wrong computations a test must tell apart."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    hf = _hf_model(folder)
    config = hf.config
    weights = load_file(str(folder / "model.safetensors"))
    prefix = f"model.layers.{config.num_hidden_layers}."
    mine = {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

    emb = weights["model.embed_tokens.weight"][torch.tensor(next_ids)]
    e, h = rms(emb, mine["enorm.weight"]), rms(hidden, mine["hnorm.weight"]) if hnorm else hidden
    x = torch.cat([h, e] if swap else [e, h], -1) @ mine["eh_proj.weight"].T
    block = LlamaDecoderLayer(config, layer_idx=0)
    block.load_state_dict({k: v for k, v in mine.items() if k.startswith(("self_attn.", "mlp.", "input_", "post_"))})
    t = x.shape[0]
    positions = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        rope = hf.model.rotary_emb(x[None], position_ids=positions)
        out = block(x[None], attention_mask=mask, position_ids=positions, position_embeddings=rope)
        out = (out[0] if isinstance(out, tuple) else out)[0]
        return out, rms(out, mine["shared_head.norm.weight"]) @ weights["lm_head.weight"].T


def hf_hidden(folder: Path, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states (after the model's norm) of ids, [len, H]."""
    with torch.no_grad():
        return _hf_model(folder).model(input_ids=torch.tensor([ids])).last_hidden_state[0]


@functools.cache
def _hf_model(folder: Path):  # noqa: ANN202
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _meta(start: int, n: int, block_ids: list[int], block_size: int) -> AttentionMetadata:
    slots = [block_ids[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
    return AttentionMetadata(torch.tensor(slots), torch.tensor([block_ids]), [0, n], [start + n], block_size)


def test_mtp_layer_equals_a_direct_reimplementation_in_one_pass_and_in_chunks(with_mtp):
    ids = random_prompts([13], vocab=500, seed=3)[0]
    hidden = hf_hidden(with_mtp, ids)[:-1]  # h_0..h_{n-2}
    next_ids = ids[1:]  # t_1..t_{n-1}: position i predicts t_{i+2}
    ref_out, ref_logits = reference_mtp(with_mtp, hidden, next_ids)
    layer = load_mtp(with_mtp, load_model(with_mtp))
    kv = layer.allocate_kv_cache(8, 4, torch.float32)
    blocks, n = [5, 2, 7, 0], len(next_ids)
    positions = torch.arange(n)
    out = layer(hidden, torch.tensor(next_ids), positions, kv, _meta(0, n, blocks, 4))
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer.compute_logits(out), ref_logits, atol=1e-4, rtol=1e-4)
    # Again in two chunks over a fresh cache: the second reads the first's keys from the paged cache.
    kv.zero_()
    first = layer(hidden[:5], torch.tensor(next_ids[:5]), positions[:5], kv, _meta(0, 5, blocks, 4))
    rest = layer(hidden[5:], torch.tensor(next_ids[5:]), positions[5:], kv, _meta(5, n - 5, blocks, 4))
    torch.testing.assert_close(torch.cat([first, rest]), ref_out, atol=1e-4, rtol=1e-4)
    # What the comparison tells apart: the concat the other way round, or no hnorm.
    for wrong in (dict(swap=True), dict(hnorm=False)):
        assert not torch.allclose(layer.compute_logits(out), reference_mtp(with_mtp, hidden, next_ids, **wrong)[1], atol=1e-2)


def test_loading_from_a_checkpoint_and_refusing_one_without(plain, with_mtp, tmp_path):
    saved = load_file(str(with_mtp / "model.safetensors"))
    layer = load_mtp(with_mtp, load_model(with_mtp))
    prefix = "model.layers.3."
    assert json.loads((with_mtp / "config.json").read_text())["num_nextn_predict_layers"] == 1
    q_rows = saved[prefix + "self_attn.q_proj.weight"].shape[0]
    assert torch.equal(layer.block.self_attn.qkv_proj.weight[:q_rows], saved[prefix + "self_attn.q_proj.weight"])
    assert torch.equal(layer.block.mlp.down_proj.weight, saved[prefix + "mlp.down_proj.weight"])
    for name in ("enorm", "hnorm", "shared_head.norm"):
        assert torch.equal(layer.get_submodule(name).weight, saved[f"{prefix}{name}.weight"])
    # The target loads as before, in the engine and in transformers, with the same logits.
    ids = random_prompts([9], vocab=500, seed=2)
    torch.testing.assert_close(hf_logits(with_mtp, ids)[0], hf_logits(plain, ids)[0], atol=0, rtol=0)
    assert LLM(str(with_mtp)).generate(ids, SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids
    with pytest.raises(ValueError, match="carries no MTP layer"):
        LLM(str(plain), speculative="mtp")
    with pytest.raises(ValueError, match="carries no MTP layer"):
        load_mtp(plain, load_model(plain))
    # DeepSeek's copies of the shared embedding and head: accepted when equal, refused when not.
    copies = tmp_path / "copies"
    copies.mkdir()
    for f in with_mtp.iterdir():
        (copies / f.name).write_bytes(f.read_bytes())
    weights = dict(saved, **{prefix + "embed_tokens.weight": saved["model.embed_tokens.weight"].clone(),
                             prefix + "shared_head.head.weight": saved["lm_head.weight"].clone()})  # fmt: skip
    save_file(weights, str(copies / "model.safetensors"), metadata={"format": "pt"})
    load_mtp(copies, load_model(copies))
    weights[prefix + "shared_head.head.weight"] = saved["lm_head.weight"] + 1
    save_file(weights, str(copies / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="differs from the target's"):
        load_mtp(copies, load_model(copies))
    moe = save_tiny_hf_model("qwen3_moe", tmp_path / "moe")
    with pytest.raises(ValueError, match="Llama family"):
        MtpLayer(load_model(moe))


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("schedule", ["fixed", "dspark"])
def test_greedy_output_equals_decoding_without_speculation_and_drafts_are_recomputable(with_mtp, schedule, monkeypatch):
    monkeypatch.setattr(speculator_module, "WARMUP_VERIFICATIONS", 8)
    prompts = random_prompts([5, 17, 33, 9, 21], vocab=500, seed=1)
    params = [_greedy(n) for n in (28, 7, 19, 28, 3)]
    expected = [o.token_ids for o in LLM(str(with_mtp), **SMALL).generate(prompts, params)]
    llm = LLM(str(with_mtp), **SMALL, speculative="mtp", spec_schedule=schedule, spec_tokens=3)
    drafter = llm.engine.speculator.drafter
    assert isinstance(drafter, MtpDrafter) and llm.engine.runner.keep_hidden
    proposals: list[tuple[list[int], tuple[int, ...]]] = []
    propose = drafter.propose

    def recording(contexts, max_tokens):  # noqa: ANN001, ANN202 - records what the real drafter proposed
        drafts = propose(contexts, max_tokens)
        proposals.extend((list(contexts[rid]), d.tokens) for rid, d in drafts.items())
        return drafts

    drafter.propose = recording
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    load = llm.engine.load()
    assert load.num_spec_verifications > 0 and load.num_spec_accepted_tokens <= load.num_spec_drafted_tokens
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks
    assert not drafter._held and len(drafter._free) == drafter.kv_cache.shape[1]  # every MTP block back
    # Each draft is what a full recomputation from the context gives (stale KV or hidden
    # states of rejected tokens would change it); checked on a spread of the proposals.
    # (dspark may choose to draft less deep or not at all from the costs it measures.)
    assert len(proposals) > (10 if schedule == "fixed" else 0)
    for context, tokens in proposals[:: max(len(proposals) // 12, 1)]:
        assert list(tokens) == _recomputed_draft(with_mtp, context, len(tokens))


def _recomputed_draft(folder: Path, context: list[int], num_tokens: int) -> list[int]:
    hidden = hf_hidden(folder, context)[:-1]
    next_ids = list(context[1:])
    drafted: list[int] = []
    for _ in range(num_tokens):
        out, logits = reference_mtp(folder, hidden, next_ids)
        top2 = logits[-1].topk(2).values
        assert top2[0] - top2[1] > 1e-4, "a near tie: pick another seed"
        drafted.append(int(logits[-1].argmax()))
        hidden = torch.cat([hidden, out[-1:]])  # the layer again, on its own output
        next_ids.append(drafted[-1])
    return drafted


def test_sampled_speculation_completes(with_mtp):
    prompts = random_prompts([7, 19, 12], vocab=500, seed=5)
    params = [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True, seed=i) for i in range(3)]
    llm = LLM(str(with_mtp), **SMALL, speculative="mtp", spec_tokens=2)
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [16, 16, 16]
    assert llm.engine.load().num_spec_verifications > 0


@pytest.mark.skipif(
    not (TRAINED / "config.json").is_file()
    or not json.loads((TRAINED / "config.json").read_text()).get("num_nextn_predict_layers"),
    reason="the trained target carries no MTP layer",
)
def test_trained_target_mtp_head_accepts_on_python():
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = LLM(str(TRAINED)).generate([prompt], params)[0]
    spec = LLM(str(TRAINED), speculative="mtp", spec_tokens=3)
    out = spec.generate([prompt], params)[0]
    assert out.token_ids == plain.token_ids
    load = spec.engine.load()
    print(f"trained target, MTP head: mean accepted length {load.mean_accepted_length:.2f}, "
          f"accepted by position {load.spec_accepted_by_position} of {load.num_spec_verifications}")  # fmt: skip
    assert load.mean_accepted_length > 1.0


def test_preemption_and_prefix_caching_with_the_mtp_drafter(with_mtp):
    prompts = random_prompts([30, 12, 25, 7, 19, 40], vocab=500, seed=2)
    params = _greedy(24)
    expected = [o.token_ids for o in LLM(str(with_mtp), block_size=4).generate(prompts, params)]
    tight = dict(block_size=4, num_kv_blocks=24, max_model_len=96, prefill_chunk_size=16)
    llm = LLM(str(with_mtp), **tight, speculative="mtp")
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.scheduler.num_preemptions > 0  # recomputed positions replace the MTP's consumed ones
    drafter = llm.engine.speculator.drafter
    assert not drafter._held and len(drafter._free) == drafter.kv_cache.shape[1]
    # A prefix hit: the target computes only the new tokens, and the MTP layer starts there.
    prefix = random_prompts([48], vocab=500, seed=3)[0]
    warm = LLM(str(with_mtp), block_size=8, speculative="mtp")
    warm.generate([prefix + [11, 12]], params)
    before = warm.engine.load().num_spec_verifications
    second = warm.generate([prefix + [21, 22]], params)[0]
    cold = LLM(str(with_mtp), block_size=8, enable_prefix_caching=False).generate([prefix + [21, 22]], params)[0]
    assert second.num_cached_tokens == 48 and second.token_ids == cold.token_ids
    assert warm.engine.load().num_spec_verifications > before
