"""DeepSeek-V4's MTP module as a drafter (issue 27, point 3), on a seeded tiny V4 written
in DeepSeek's released format (tools/release_formats.py: FP8 ue8m0 tiles, FP4 experts,
an ``mtp.0`` block, three shards):

- the module's forward equals DeepSeek's MTPBlock formula written out here from the
  checkpoint's decoded tensors (plain torch for the norms, projections and hyper head;
  transformers' own DeepseekV4DecoderLayer for the block), in one pass and in chunks over
  the paged cache, and the wrong variants (norms swapped, projections swapped, the
  model's hyper head in place of the module's) are far from it;
- it loads the values the released files decode to; a checkpoint without it, a missing,
  misshapen or unknown mtp tensor are errors that name it;
- the engine with V4 MTP speculation (fixed and DSpark schedules) gives the greedy tokens
  of V4 without speculation, and the tokens verification emits carry the logprobs of the
  plain run within 1e-5.
"""

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import shared.engine.model_runner as runner_module
import shared.engine.spec.speculator as speculator_module
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.engine.spec.mtp_drafter import MtpDrafter
from shared.model.checkpoint_files import INDEX_FILE, SINGLE_FILE
from shared.model.forward_batch import AttentionMetadata
from shared.model.loader import CheckpointError, load_model
from shared.model.models.deepseek_v4_mtp import V4MtpLayer, load_v4_mtp
from tests.helpers.deepseek_v4_models import save_tiny_v4
from tests.helpers.hf_models import random_prompts
from tools import release_formats as rf

pytest.importorskip("transformers")

TOLERANCE = 1e-4  # float32 through different kernels, as the V4 parity tests
LOGPROB_TOLERANCE = 1e-5
SMALL = dict(block_size=4, prefill_chunk_size=8, max_num_batched_tokens=24)
"""Prompts span blocks, prefill is chunked, decode steps mix with prefill chunks."""


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(released, reference, seeded source): the tiny "mixed" V4 (window 16, every kind of
    layer) with 3 mHC streams, released in DeepSeek's format with its mtp.0 block."""
    root = tmp_path_factory.mktemp("v4mtp")
    src = save_tiny_v4("mixed", root / "src", seed=3, hc_mult=3)
    released = rf.write_v4_deepseek(src, root / "released", root / "reference", mtp_seed=11)
    return released, root / "reference", src


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / INDEX_FILE).is_file():
        files = sorted(set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values()))
        return {k: v for f in files for k, v in load_file(str(folder / f)).items()}
    return load_file(str(folder / SINGLE_FILE))


@functools.cache
def _hf(folder: Path):  # noqa: ANN202 - a transformers model
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_streams(reference: Path, ids: list[int]) -> torch.Tensor:
    """transformers' residual streams [len, hc, H] before the hyper head, for ids."""
    model = _hf(reference)
    seen: list[torch.Tensor] = []
    hook = model.model.hc_head.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        hook.remove()
    return seen[0][0]


@functools.cache
def _hf_block(reference: Path, root: Path):  # noqa: ANN202 - transformers' DeepseekV4DecoderLayer
    """transformers' V4 decoder layer holding the mtp.0 block's decoded tensors: a one-layer
    (sliding, learned router) V4 checkpoint in transformers' saved names, loaded by it."""
    weights = _tensors(reference)
    config = json.loads((reference / "config.json").read_text())
    config.update(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    own = ("enorm.", "hnorm.", "e_proj.", "h_proj.", "norm.", "hc_head_")
    block = {
        "model.layers.0." + k.removeprefix("mtp.0.").replace("attn.kv_norm.", "attn.norm."): v
        for k, v in weights.items()
        if k.startswith("mtp.0.") and not k.removeprefix("mtp.0.").startswith(own)
    }
    top = ("model.embed_tokens.weight", "model.norm.weight", "head.weight", "model.hc_head.hc_fn",
           "model.hc_head.hc_base", "model.hc_head.hc_scale")  # fmt: skip
    folder = root / "hf_block"
    folder.mkdir(exist_ok=True)
    save_file({**block, **{k: weights[k] for k in top}}, str(folder / SINGLE_FILE), {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    model = _hf(folder)
    return model.model.layers[0], model.model.rotary_emb, config


def reference_mtp(
    reference: Path, root: Path, streams: torch.Tensor, next_ids: list[int], wrong: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output streams [T, hc, H], logits [T, vocab]) of DeepSeek's MTPBlock over one
    sequence from position 0, from the checkpoint's decoded tensors:

        x = e_proj(enorm(embed(t)))[:, None] + h_proj(hnorm(h))     # h: [T, hc, H]
        o = block(x)
        logits = head(norm(hc_head(o)))   # the module's own hyper head and norm

    wrong: "norms" (enorm and hnorm swapped), "projections" (e_proj and h_proj swapped),
    "model_head" (the model's hyper head and norm in place of the module's)."""
    w = _tensors(reference)
    m = {k.removeprefix("mtp.0."): v for k, v in w.items() if k.startswith("mtp.0.")}
    block, rotary, config = _hf_block(reference, root)
    eps, hc_eps, window = config["rms_norm_eps"], config["hc_eps"], config["sliding_window"]

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    enorm, hnorm = (m["hnorm.weight"], m["enorm.weight"]) if wrong == "norms" else (m["enorm.weight"], m["hnorm.weight"])
    e_proj, h_proj = (m["h_proj.weight"], m["e_proj.weight"]) if wrong == "projections" else (m["e_proj.weight"], m["h_proj.weight"])
    e = rms(w["model.embed_tokens.weight"][torch.tensor(next_ids)], enorm)
    x = (e @ e_proj.T)[:, None, :] + rms(streams, hnorm) @ h_proj.T
    t = x.shape[0]
    positions = torch.arange(t)[None]
    distance = positions[0][:, None] - positions[0][None, :]
    mask = torch.where((distance >= 0) & (distance < window), 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        rope = {kind: rotary(x[None, :, 0], position_ids=positions, layer_type=kind) for kind in ("main", "compress")}
        out = block(x[None], position_embeddings=rope, position_ids=positions, attention_mask=mask, input_ids=None)[0]
    if wrong == "model_head":
        fn, base, scale, norm = (w["model.hc_head.hc_fn"], w["model.hc_head.hc_base"], w["model.hc_head.hc_scale"],
                                 w["model.norm.weight"])  # fmt: skip
    else:
        fn, base, scale, norm = m["hc_head_fn"], m["hc_head_base"], m["hc_head_scale"], m["norm.weight"]
    flat = out.flatten(-2)
    mixes = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)) @ fn.T
    pre = torch.sigmoid(mixes * scale + base) + hc_eps
    collapsed = (pre[..., None] * out).sum(-2)
    return out, rms(collapsed, norm) @ w["head.weight"].T


def _meta(start: int, n: int, block_ids: list[int], block_size: int) -> AttentionMetadata:
    slots = [block_ids[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
    return AttentionMetadata(torch.tensor(slots), torch.tensor([block_ids]), [0, n], [start + n], block_size)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_forward_equals_deepseeks_formula_and_the_wrong_variants_do_not(v4, tmp_path_factory) -> None:
    released, reference, _ = v4
    root = tmp_path_factory.mktemp("ref")
    ids = random_prompts([27], vocab=512, seed=4)[0]  # past the window of 16
    streams = hf_streams(reference, ids)[:-1]  # h_0 .. h_{n-2}
    next_ids = ids[1:]  # position i reads t_{i+1}, predicts t_{i+2}
    ref_out, ref_logits = reference_mtp(reference, root, streams, next_ids)
    layer = load_v4_mtp(released, load_model(released))
    n, hc = len(next_ids), streams.shape[1]
    kv = layer.allocate_kv_cache(12, 4, torch.float32)
    blocks = [5, 2, 7, 0, 9, 3, 11]
    out = layer(streams.flatten(1), torch.tensor(next_ids), torch.arange(n), kv, _meta(0, n, blocks, 4))
    logits = layer.compute_logits(out)
    assert _rel_err(out.view(n, hc, -1), ref_out) < TOLERANCE
    assert _rel_err(logits, ref_logits) < TOLERANCE
    # Again in two chunks over a fresh cache: the second reads the first's window from the paged cache.
    kv.zero_()
    h, t, pos = streams.flatten(1), torch.tensor(next_ids), torch.arange(n)
    first = layer(h[:9], t[:9], pos[:9], kv, _meta(0, 9, blocks, 4))
    rest = layer(h[9:], t[9:], pos[9:], kv, _meta(9, n - 9, blocks, 4))
    assert _rel_err(layer.compute_logits(torch.cat([first, rest])), ref_logits) < TOLERANCE
    # The comparison tells DeepSeek's formula from its near misses: each is far off.
    for wrong in ("norms", "projections", "model_head"):
        off = _rel_err(reference_mtp(reference, root, streams, next_ids, wrong)[1], ref_logits)
        assert off > 100 * TOLERANCE, (wrong, off)


def test_loads_the_decoded_release_and_names_what_is_wrong(v4, tmp_path: Path) -> None:
    released, reference, src = v4
    target = load_model(released)
    layer = load_v4_mtp(released, target)
    assert target.keep_streams  # the target hands its streams over from now on
    decoded = _tensors(reference)
    tensors = layer.checkpoint_tensors()
    assert len(tensors) > 40 and set(tensors) <= set(decoded)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, decoded[name].to(tensor.dtype)), name
    with pytest.raises(ValueError, match="carries no MTP layer"):
        load_v4_mtp(src, load_model(src))

    def broken(name: str, drop: tuple[str, ...] = (), put: dict[str, torch.Tensor] | None = None) -> Path:
        folder = tmp_path / name
        shutil.copytree(released, folder)
        index = json.loads((folder / INDEX_FILE).read_text())
        for file in sorted(set(index["weight_map"].values())):
            stored = load_file(str(folder / file))
            if set(drop) & set(stored) or set(put or {}) & set(stored):
                stored = {k: (put or {}).get(k, v) for k, v in stored.items() if k not in drop}
                save_file(stored, str(folder / file), {"format": "pt"})
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in drop}
        (folder / INDEX_FILE).write_text(json.dumps(index))
        return folder

    missing = broken("missing", drop=("mtp.0.h_proj.weight", "mtp.0.h_proj.scale"))
    with pytest.raises(CheckpointError, match=r"the MTP layer lacks mtp\.0\.h_proj\.weight"):
        load_v4_mtp(missing, load_model(missing))
    hidden = tensors["mtp.0.hnorm.weight"].shape[0]
    misshapen = broken("misshapen", put={"mtp.0.hnorm.weight": torch.ones(hidden + 1, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match=r"mtp\.0\.hnorm\.weight has shape \(65,\), expected \(64,\)"):
        load_v4_mtp(misshapen, load_model(misshapen))
    scale = broken("scale", put={"mtp.0.e_proj.scale": torch.ones(2, 2).to(torch.float8_e8m0fnu)})
    with pytest.raises(CheckpointError, match=r"mtp\.0\.e_proj\.weight with mtp\.0\.e_proj\.scale: scale shape"):
        load_v4_mtp(scale, load_model(scale))


def _greedy(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)


@pytest.mark.parametrize("schedule", ["fixed", "dspark"])
def test_greedy_output_and_logprobs_equal_v4_without_speculation(v4, schedule: str, monkeypatch,
                                                                  tmp_path_factory) -> None:  # fmt: skip
    released, reference, _ = v4
    monkeypatch.setattr(speculator_module, "WARMUP_VERIFICATIONS", 8)
    prompts = random_prompts([5, 23, 11, 30], vocab=512, seed=1)
    lengths = (20, 9, 20, 14)
    plain = LLM(str(released), **SMALL).generate(prompts, [_greedy(n, logprobs=0) for n in lengths])
    llm = LLM(str(released), **SMALL, speculative="mtp", spec_schedule=schedule, spec_tokens=3)
    drafter = llm.engine.speculator.drafter
    assert isinstance(drafter, MtpDrafter) and isinstance(drafter.layer, V4MtpLayer) and llm.engine.runner.keep_hidden
    # The logprob of every token verification emits, by (request, output index), from the verified rows.
    emitted: dict[tuple[str, int], float] = {}
    verify = runner_module.verify_batch
    rid_of = {}

    def recording(logits, drafts, states, sampler, first_positions):  # noqa: ANN001, ANN202 - wraps the real one
        results = verify(logits, drafts, states, sampler, first_positions)
        rid_of.update({id(s): rid for rid, s in llm.engine.runner.states.items()})
        row = 0
        for draft, state, v in zip(drafts, states, results):
            logprobs = logits[row : row + len(draft) + 1].log_softmax(-1)
            for k, token in enumerate(v.tokens):
                emitted[(rid_of[id(state)], len(state.output_token_ids) + k)] = float(logprobs[k, token])
            row += len(draft) + 1
        return results

    monkeypatch.setattr(runner_module, "verify_batch", recording)
    proposals: list[tuple[list[int], tuple[int, ...]]] = []
    propose = drafter.propose

    def recorded(contexts, max_tokens):  # noqa: ANN001, ANN202 - records what the real drafter proposed
        drafts = propose(contexts, max_tokens)
        proposals.extend((list(contexts[rid]), d.tokens) for rid, d in drafts.items())
        return drafts

    drafter.propose = recorded
    spec = llm.generate(prompts, [_greedy(n) for n in lengths])
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    load = llm.engine.load()
    assert load.num_spec_verifications > 0 and load.num_spec_drafted_tokens > 0
    assert load.num_spec_accepted_tokens <= load.num_spec_drafted_tokens
    order = {o.request_id: i for i, o in enumerate(spec)}
    assert len(emitted) > (10 if schedule == "fixed" else 0)  # dspark verifies little of random drafts
    for (rid, index), logprob in emitted.items():
        assert abs(logprob - plain[order[rid]].logprobs[index].logprob) < LOGPROB_TOLERANCE, (rid, index)
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_total_blocks  # every size class
    assert not drafter._held and len(drafter._free) == drafter.kv_cache.shape[1]  # every MTP block back
    # Each draft is DeepSeek's formula over the target's streams, chained on its own output
    # (stale window KV, streams of rejected tokens or the collapsed state would change it).
    assert len(proposals) > (10 if schedule == "fixed" else 0)
    root = tmp_path_factory.mktemp("recompute")
    for context, tokens in proposals[:: max(len(proposals) // 6, 1)]:
        assert list(tokens) == _recomputed_draft(reference, root, context, len(tokens))


def _recomputed_draft(reference: Path, root: Path, context: list[int], num_tokens: int) -> list[int]:
    streams = hf_streams(reference, context)[:-1]
    next_ids = list(context[1:])
    drafted: list[int] = []
    for _ in range(num_tokens):
        out, logits = reference_mtp(reference, root, streams, next_ids)
        top2 = logits[-1].topk(2).values
        assert top2[0] - top2[1] > 1e-4, "a near tie: pick another seed"
        drafted.append(int(logits[-1].argmax()))
        streams = torch.cat([streams, out[-1:]])  # the module again, on its own output streams
        next_ids.append(drafted[-1])
    return drafted
