"""DeepSeek-V4's mHC (shared/model/hyper_connections.py) against transformers 5.24 with
mixing weights that matter, float32, within 1e-5.

The tiny checkpoints of test_deepseek_v4.py keep the mHC weights at 0.05 noise, so every
comb matrix is nearly uniform: a one-step Sinkhorn (~1e-4) or the comb used untransposed
(~1e-6) stays inside that file's 1e-4. Here the mHC weights are drawn large
(tests/helpers/deepseek_v4_models.py's strong_mhc_): comb's rows are peaked, Sinkhorn's
iterations move it far and the result is far from symmetric (3 and 4 streams: a 2x2
doubly stochastic matrix is symmetric, so 2 streams cannot tell a transpose).

- one layer's mHC (the attention's and the MoE's hyper-connection and their merges, the
  blocks stubbed) and the hyper head equal transformers' within 1e-5;
- a whole tiny V4's logits (prefill, then decode steps) equal transformers' within 1e-5;
- each with the two wrong variants run beside it (Sinkhorn cut to one iteration; comb
  used untransposed): both are off by more than 1e-2, a thousand times the tolerance,
  so the tolerance separates right from wrong.
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import shared.model.models.deepseek_v4 as v4_module
from shared.model.hyper_connections import HyperConnection, HyperHead, merge_streams
from tests.helpers.deepseek_v4_models import _COMMON, V4_VARIANTS, save_tiny_v4, strong_mhc_
from tests.helpers.hf_models import ParityCase, parity_case
from tests.helpers.numerics import rel_err
from tests.helpers.paged_driver import PagedDriver

pytest.importorskip("transformers")

TOLERANCE = 1e-5
WRONG = 1e-2  # what each wrong variant must be off by, at least (measured: 0.08 to 0.74)
BLOCK = 16
NUM_DECODE = 3
TOKENS = 40


def transposed_merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """merge_streams with comb used the other way round (out_k = sum_j comb[k, j] * in_j)."""
    return merge_streams(streams, block_out, post, comb.transpose(-1, -2))


def one_sinkhorn_step(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every HyperConnection of model cut to one Sinkhorn iteration (until the test ends)."""
    for m in model.modules():
        if isinstance(m, HyperConnection):
            monkeypatch.setattr(m, "sinkhorn_iters", 1)


# -- one layer's mHC ------------------------------------------------------------------------


class _Block(nn.Module):
    """A stand-in for attention or the MoE: tanh of a fixed random linear map."""

    def __init__(self, hidden: int, g: torch.Generator, returns_pair: bool) -> None:
        super().__init__()
        self.w = torch.randn(hidden, hidden, generator=g) / hidden**0.5
        self.returns_pair = returns_pair

    def forward(self, x: torch.Tensor, **_: Any) -> Any:
        out = torch.tanh(x @ self.w)
        return (out, None) if self.returns_pair else out


def hf_layer_and_ours(hc: int) -> tuple[Any, nn.Module, Callable[..., torch.Tensor], Any, HyperHead]:
    """transformers' DeepseekV4DecoderLayer with its attention and MoE stubbed, and ours:
    the same mHC weights (strong), the same stubs and norms around our HyperConnection and
    merge_streams (our hyper-connections are returned too); transformers' hyper head and ours."""
    import transformers
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4HyperHead

    config = transformers.DeepseekV4Config(**{**_COMMON, **V4_VARIANTS["mixed"], "hc_mult": hc})
    torch.manual_seed(0)
    layer = DeepseekV4DecoderLayer(config, 0).float().eval()
    head = DeepseekV4HyperHead(config).float()
    g = torch.Generator().manual_seed(hc)
    holder = nn.Module()
    holder.add_module("layer", layer)
    holder.add_module("hc_head", head)
    strong_mhc_(holder, g)
    layer.self_attn = _Block(config.hidden_size, g, returns_pair=True)
    layer.mlp = _Block(config.hidden_size, g, returns_pair=False)

    args = (config.hidden_size, hc, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps, torch.device("cpu"))
    attn_hc, ffn_hc = HyperConnection(*args), HyperConnection(*args)
    attn_hc.load_state_dict(layer.attn_hc.state_dict())
    ffn_hc.load_state_dict(layer.ffn_hc.state_dict())
    ours_head = HyperHead(config.hidden_size, hc, config.hc_eps, config.rms_norm_eps, torch.device("cpu"))
    ours_head.load_state_dict(head.state_dict())

    def ours(streams: torch.Tensor, merge: Callable[..., torch.Tensor] = merge_streams) -> torch.Tensor:
        """The layer as DeepseekV4ForCausalLM.forward runs it, on streams [T, hc, hidden]."""
        post, comb, collapsed = attn_hc(streams)
        streams = merge(streams, layer.self_attn(layer.input_layernorm(collapsed))[0], post, comb)
        post, comb, collapsed = ffn_hc(streams)
        return merge(streams, layer.mlp(layer.post_attention_layernorm(collapsed)), post, comb)

    return layer, nn.ModuleList([attn_hc, ffn_hc]), ours, head, ours_head


@pytest.mark.parametrize("hc", [3, 4])
def test_one_layers_mhc_and_the_head_match_transformers_and_the_wrong_variants_do_not(
    hc: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer, hcs, ours, head, ours_head = hf_layer_and_ours(hc)
    streams = torch.randn(1, TOKENS, hc, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        # The weights are strong: comb after Sinkhorn is far from uniform and from symmetric.
        _, comb, _ = layer.attn_hc(streams)
        assert (comb - 1 / hc).abs().amax().item() > 0.3
        assert (comb - comb.transpose(-1, -2)).abs().amax().item() > 0.3
        expected = layer(streams)
        assert rel_err(ours(streams[0]), expected[0]) < TOLERANCE
        assert rel_err(ours_head(expected[0]), head(expected)[0]) < TOLERANCE

        transposed = rel_err(ours(streams[0], merge=transposed_merge), expected[0])
        one_sinkhorn_step(hcs, monkeypatch)
        one_step = rel_err(ours(streams[0]), expected[0])
    assert transposed > WRONG, f"comb used untransposed is off by only {transposed:.2e}"
    assert one_step > WRONG, f"a one-step Sinkhorn is off by only {one_step:.2e}"


# -- a whole tiny V4 -----------------------------------------------------------------------


@pytest.fixture(scope="module", params=[("mixed", 4), ("hca_first", 3)], ids=lambda p: f"{p[0]}-hc{p[1]}")
def strong(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ParityCase:
    variant, hc = request.param
    path = save_tiny_v4(variant, tmp_path_factory.mktemp(f"{variant}_strong_mhc"), seed=1, strong_mhc=True, hc_mult=hc)
    return parity_case(path, (TOKENS, 67), NUM_DECODE, seed=2, low=3, vocab=512)


def worst_err(case: ParityCase) -> float:
    """The largest rel_err over a varlen prefill of both prompts and NUM_DECODE batched decode steps."""
    driver = PagedDriver(case.model, num_seqs=2, num_blocks=256, block_size=BLOCK)
    out = driver.step(dict(enumerate(case.prompts)))
    errs = [rel_err(out[s], case.reference[s][: len(p)]) for s, p in enumerate(case.prompts)]
    for k in range(NUM_DECODE):
        out = driver.step({s: [case.full[s][len(p) + k]] for s, p in enumerate(case.prompts)})
        errs += [rel_err(out[s], case.reference[s][len(p) + k : len(p) + k + 1]) for s, p in enumerate(case.prompts)]
    return max(errs)


def test_strong_mhc_logits_match_transformers(strong: ParityCase) -> None:
    assert worst_err(strong) < TOLERANCE


def test_strong_mhc_logits_with_comb_untransposed_do_not(strong: ParityCase, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(v4_module, "merge_streams", transposed_merge)
    assert worst_err(strong) > WRONG


def test_strong_mhc_logits_with_a_one_step_sinkhorn_do_not(strong: ParityCase, monkeypatch: pytest.MonkeyPatch) -> None:
    one_sinkhorn_step(strong.model, monkeypatch)
    assert worst_err(strong) > WRONG
