"""The shared MoE layers (shared/model/moe.py) against plain per-token references:
every router variant (softmax, sigmoid, sqrtsoftplus, GPT-OSS's softmax over the
top-k logits; renormalised or not, with an epsilon, scaled, a selection-only bias,
hash routing through tid2eid), the experts (SiLU halves with and without the
swiglu clamp, GPT-OSS's interleaved clamped gate with biases), shared experts, and
the per-expert token counts. DeepSeek-V4's router math is also checked against
transformers' own DeepseekV4 router classes."""

import math

import pytest
import torch
import torch.nn.functional as F

from shared.model.moe import Experts, SparseMoE, route
from shared.model.moe_config import MoEConfig

E, K, HIDDEN, INTER, T = 8, 3, 16, 12, 11
# Softmax scores are computed in float32 whatever the logits' dtype (as Qwen3-MoE's router).
ROUTE_TOL = dict(rtol=1e-6, atol=1e-7)


def plain_route(logits: torch.Tensor, moe: MoEConfig, bias=None, hashed=None):
    """One token at a time, in Python: the scores, the chosen experts, their weights."""
    weights, ids = [], []
    for t, row in enumerate(logits.tolist()):
        if moe.scoring == "softmax_topk":
            chosen = sorted(range(E), key=lambda e: -row[e])[:K]
            top = [row[e] for e in chosen]
            m = max(top)
            w = [math.exp(v - m) / sum(math.exp(u - m) for u in top) for v in top]
        else:
            if moe.scoring == "softmax":
                m = max(row)
                scores = [math.exp(v - m) / sum(math.exp(u - m) for u in row) for v in row]
            elif moe.scoring == "sigmoid":
                scores = [1 / (1 + math.exp(-v)) for v in row]
            else:
                scores = [math.sqrt(math.log1p(math.exp(v))) for v in row]
            if hashed is not None:
                chosen = hashed[t].tolist()
            else:
                key = [s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(scores)]
                chosen = sorted(range(E), key=lambda e: -key[e])[:K]
            w = [scores[e] for e in chosen]
        if moe.norm_topk_prob:
            total = sum(w) + moe.renorm_eps
            w = [v / total for v in w]
        w = [v * moe.routed_scaling_factor for v in w]
        weights.append(w)
        ids.append(chosen)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(ids)


ROUTERS = {
    "qwen_softmax": MoEConfig(E, K, INTER, "softmax"),
    "qwen_softmax_renorm": MoEConfig(E, K, INTER, "softmax", norm_topk_prob=True),
    "gpt_oss_softmax_topk": MoEConfig(E, K, INTER, "softmax_topk"),
    "sigmoid_renorm_scaled": MoEConfig(E, K, INTER, "sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5),
    "sqrtsoftplus_eps_scaled": MoEConfig(
        E, K, INTER, "sqrtsoftplus", norm_topk_prob=True, renorm_eps=1e-20, routed_scaling_factor=1.5
    ),
    "sigmoid_not_renormalised": MoEConfig(E, K, INTER, "sigmoid"),
}


def sorted_by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The k choices of each token in expert order (top-k order is not part of the contract)."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("name", list(ROUTERS))
def test_route_matches_the_plain_reference(name: str) -> None:
    moe = ROUTERS[name]
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weights, ids = route(logits, moe)
    ref_w, ref_ids = plain_route(logits, moe)
    w, i = sorted_by_expert(weights, ids)
    rw, ri = sorted_by_expert(ref_w, ref_ids)
    assert torch.equal(i, ri)
    torch.testing.assert_close(w, rw, **ROUTE_TOL)


@pytest.mark.parametrize("scoring", ["sigmoid", "sqrtsoftplus"])
def test_selection_bias_chooses_but_does_not_weigh(scoring: str) -> None:
    moe = MoEConfig(E, K, INTER, scoring, norm_topk_prob=True, selection_bias=True)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    bias = torch.randn(E, generator=g, dtype=torch.float64)
    weights, ids = route(logits, moe, selection_bias=bias)
    ref_w, ref_ids = plain_route(logits, moe, bias=bias)
    w, i = sorted_by_expert(weights, ids)
    rw, ri = sorted_by_expert(ref_w, ref_ids)
    assert torch.equal(i, ri)
    torch.testing.assert_close(w, rw, **ROUTE_TOL)
    assert not torch.equal(ids.sort(-1).values, route(logits, moe)[1].sort(-1).values)  # the bias changed choices


def test_hash_routing_takes_the_tables_experts() -> None:
    moe = MoEConfig(E, K, INTER, "sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(50)])
    input_ids = torch.randint(0, 50, (T,), generator=g)
    weights, ids = route(logits, moe, hashed_ids=tid2eid[input_ids])
    ref_w, ref_ids = plain_route(logits, moe, hashed=tid2eid[input_ids])
    assert torch.equal(ids, tid2eid[input_ids])
    torch.testing.assert_close(weights, ref_w, **ROUTE_TOL)


def test_deepseek_v4_routers_match_transformers() -> None:
    """The V4 variants equal transformers' DeepseekV4TopKRouter / DeepseekV4HashRouter."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    config = transformers.DeepseekV4Config(
        hidden_size=HIDDEN, num_local_experts=E, num_experts_per_tok=K, vocab_size=50, routed_scaling_factor=1.5
    )
    moe = MoEConfig(
        E, K, INTER, config.scoring_func, norm_topk_prob=True, renorm_eps=1e-20,
        routed_scaling_factor=config.routed_scaling_factor, selection_bias=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, HIDDEN, generator=g)
    topk, hashed = v4.DeepseekV4TopKRouter(config), v4.DeepseekV4HashRouter(config)
    with torch.no_grad():
        for router in (topk, hashed):
            router.weight.copy_(torch.randn(E, HIDDEN, generator=g))
        topk.e_score_correction_bias.copy_(torch.randn(E, generator=g))
        hashed.tid2eid.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(50)]))
    input_ids = torch.randint(0, 50, (1, T), generator=g)
    _, hf_w, hf_ids = topk(x[None])
    w, ids = route(F.linear(x, topk.weight), moe, selection_bias=topk.e_score_correction_bias)
    a, b = sorted_by_expert(w, ids), sorted_by_expert(hf_w, hf_ids)
    assert torch.equal(a[1], b[1])
    torch.testing.assert_close(a[0], b[0])
    _, hf_w, hf_ids = hashed(x[None], input_ids)
    no_bias = MoEConfig(E, K, INTER, config.scoring_func, norm_topk_prob=True, renorm_eps=1e-20,
                        routed_scaling_factor=config.routed_scaling_factor)  # fmt: skip
    w, ids = route(F.linear(x, hashed.weight), no_bias, hashed_ids=hashed.tid2eid[input_ids[0]])
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w)


def plain_experts(experts: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Token by token, choice by choice, each expert's weights sliced out by hand."""
    moe = experts.moe
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for c in range(ids.shape[1]):
            e = int(ids[t, c])
            h = experts.gate_up_proj[e] @ x[t]
            if experts.gate_up_proj_bias is not None:
                h = h + experts.gate_up_proj_bias[e]
            if moe.activation == "gpt_oss":
                gate, up = h[0::2].clamp(max=moe.swiglu_limit), h[1::2].clamp(-moe.swiglu_limit, moe.swiglu_limit)
                a = (up + 1) * gate * torch.sigmoid(moe.swiglu_alpha * gate)
            else:
                gate, up = h[:INTER], h[INTER:]
                if moe.swiglu_limit is not None:
                    gate, up = gate.clamp(max=moe.swiglu_limit), up.clamp(-moe.swiglu_limit, moe.swiglu_limit)
                a = gate * torch.sigmoid(gate) * up
            y = experts.down_proj[e] @ a
            if experts.down_proj_bias is not None:
                y = y + experts.down_proj_bias[e]
            out[t] += weights[t, c] * y
    return out


EXPERTS = {
    "silu": MoEConfig(E, K, INTER),
    "silu_clamped": MoEConfig(E, K, INTER, swiglu_limit=0.5),
    "gpt_oss_biased": MoEConfig(E, K, INTER, "softmax_topk", expert_bias=True, activation="gpt_oss", swiglu_limit=0.5),
}


@pytest.mark.parametrize("name", list(EXPERTS))
def test_experts_match_the_plain_reference(name: str) -> None:
    moe = EXPERTS[name]
    g = torch.Generator().manual_seed(4)
    experts = Experts(HIDDEN, moe, torch.float64, torch.device("cpu"))
    for p in experts.parameters():
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    x = torch.randn(T, HIDDEN, generator=g, dtype=torch.float64)
    # Expert 0 gets nobody, expert 1 most tokens: empty and long runs both occur.
    ids = torch.stack([torch.tensor([1, *torch.randperm(E - 2, generator=g)[: K - 1].add(2).tolist()]) for _ in range(T)])
    weights = torch.rand(T, K, generator=g, dtype=torch.float64)
    torch.testing.assert_close(experts(x, ids, weights), plain_experts(experts, x, ids, weights), rtol=1e-12, atol=1e-12)
    if moe.swiglu_limit is not None:  # the clamp bites on these inputs
        unclamped = Experts(HIDDEN, MoEConfig(E, K, INTER, moe.scoring, expert_bias=moe.expert_bias,
                                              activation=moe.activation, swiglu_limit=1e9), torch.float64, "cpu")  # fmt: skip
        unclamped.load_state_dict(experts.state_dict())
        assert (unclamped(x, ids, weights) - experts(x, ids, weights)).abs().max() > 1e-3


def test_sparse_block_with_shared_experts_and_hash_routing_counts_tokens() -> None:
    """A V4-style block: hash-routed, sigmoid scores, shared experts added; its counts
    row receives tokens per expert of the last forward (overwritten, not summed)."""
    moe = MoEConfig(E, K, INTER, "sigmoid", norm_topk_prob=True, swiglu_limit=0.5, num_shared_experts=1,
                    shared_intermediate_size=INTER)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    block = SparseMoE(HIDDEN, moe, "hash_moe", 50, torch.float64, torch.device("cpu"))
    for name, p in block.named_parameters():
        if name != "gate.tid2eid":
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    block.gate.tid2eid.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(50)]))
    block.counts = torch.full((E,), 99, dtype=torch.int64)
    x = torch.randn(T, HIDDEN, generator=g, dtype=torch.float64)
    input_ids = torch.randint(0, 50, (T,), generator=g)
    out = block(x, input_ids)
    weights, ids = route(F.linear(x, block.gate.weight), moe, hashed_ids=block.gate.tid2eid[input_ids])
    shared = block.shared_experts
    assert shared is not None
    h = F.linear(x, shared.gate_up_proj.weight)
    gate, up = h[:, :INTER].clamp(max=0.5), h[:, INTER:].clamp(-0.5, 0.5)
    expected = plain_experts(block.experts, x, ids, weights) + F.linear(F.silu(gate) * up, shared.down_proj.weight)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(block.counts, torch.bincount(block.gate.tid2eid[input_ids].reshape(-1), minlength=E))
    with pytest.raises(ValueError, match="input ids"):
        block(x)


def test_moe_config_refuses_what_cannot_route() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEConfig(4, 5, INTER)
    with pytest.raises(ValueError, match="scoring"):
        MoEConfig(4, 2, INTER, "tanh")  # type: ignore[arg-type]
