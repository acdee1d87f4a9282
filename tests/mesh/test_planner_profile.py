"""`infermesh profile` against a real mesh (nats-server, kvcache, prefill, decode and
the balancer as processes): a tiny sweep from the command line writes a profile the
planner can load, with the points asked for, figures that move the way the work
does (gross ratios only: the machine is shared), the handoff's rate, and where it
came from; and the kvcache round: a prompt no instance holds after POST
/reset_prefix_cache is loaded from kvcache (the prefill worker's counters with
path="kvcache" grow by the round's blocks), and its rate is in the profile."""

import json
import shlex
import sys
from pathlib import Path

from services.planner.profile import Profile
from shared.model.config import ModelConfig
from tools.cli import main
from tools.planner.mesh_facts import scrape
from tools.planner.kvcache_round import BYTES, SECONDS, kvcache_delta

PREFILL_LENGTHS, DECODE_BATCHES, CONTEXT, KVCACHE_LENGTH, ROUNDS = (64, 512), (1, 4), 1024, 200, 3


def test_a_tiny_sweep_writes_a_profile_the_planner_loads(start_mesh, mesh_model_dir, tmp_path, capsys):
    mesh = start_mesh(extra_env={"INFERMESH_BALANCER__PREFIX_CACHE_RESET": "true"})  # the kvcache round resets
    metrics = [f"http://127.0.0.1:{port}/metrics" for name, port in mesh.metrics_ports.items()
               if name.startswith(("prefill", "decode"))]  # fmt: skip
    out, raw = tmp_path / "profile.json", tmp_path / "profile.txt"
    args = ["profile", "--url", mesh.api_url, "--out", str(out), "--raw", str(raw), "--budget-s", "600",
            "--prefill-lengths", *map(str, PREFILL_LENGTHS), "--prefill-concurrency", "1",
            "--decode-batches", *map(str, DECODE_BATCHES), "--decode-contexts", str(CONTEXT),
            "--decode-max-tokens", "24", "--rounds", str(ROUNDS), "--model-dir", mesh_model_dir,
            "--kvcache-lengths", str(KVCACHE_LENGTH)]  # fmt: skip
    for url in metrics:
        args += ["--metrics-url", url]
    prefill_metrics = [f"http://127.0.0.1:{port}/metrics" for name, port in mesh.metrics_ports.items()
                       if name.startswith("prefill")]  # fmt: skip
    before = [scrape(u) for u in prefill_metrics]
    assert main(args) == 0
    after = [scrape(u) for u in prefill_metrics]

    profile = Profile.load(out)
    assert json.loads(profile.to_json()) == json.loads(out.read_text())  # nothing lost on the way back
    assert [(p.input_tokens, p.concurrency) for p in profile.prefill] == [(64, 1), (512, 1)]
    assert [(d.batch, d.context_tokens) for d in profile.decode] == [(1, CONTEXT), (4, CONTEXT)]
    short, long = profile.prefill
    assert long.ttft_ms > short.ttft_ms  # 8x the prompt takes longer to the first token
    one, four = profile.decode
    assert four.tokens_per_s > one.tokens_per_s  # a batch of 4 decodes more tokens a second than 1
    assert all(p.ttft_ms > 0 and p.tokens_per_s > 0 for p in profile.prefill)
    assert all(d.itl_ms > 0 for d in profile.decode)

    # The command is this process's own (pytest's here; `infermesh profile ...` from a shell).
    assert profile.commit and profile.commit != "unknown" and profile.device
    assert profile.command == shlex.join(getattr(sys, "orig_argv", sys.argv))
    assert profile.model == Path(mesh_model_dir).name  # the balancer's model id
    assert profile.settings["decode.speculation"] == "off" and profile.settings["sweep.rounds"] == "3"
    config = ModelConfig.from_pretrained(mesh_model_dir)
    assert profile.transfer.kv_bytes_per_token == (
        config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2 * 4  # float32
    )
    text = raw.read_text()
    assert text.startswith("# commit: ") and "kv_bytes_per_token_from_metrics" in text
    # The handoffs' bytes over the handed-off prompt tokens agree with the config's formula.
    measured = next(line for line in text.splitlines() if line.startswith("kv_bytes_per_token_from_metrics"))
    assert measured.split(": ")[1] == str(profile.transfer.kv_bytes_per_token)
    # The handoffs' bytes over the seconds the decode worker's loads took (kv_transfer_seconds_total).
    assert profile.transfer.handoff_gb_s is not None and profile.transfer.handoff_gb_s > 0
    assert f"handoff_gb_s: {profile.transfer.handoff_gb_s:.3f}" in text
    assert "skipped by the budget: none" in text

    # The kvcache round: every round's second request (the warm-up's too) loaded the prompt's
    # full blocks from kvcache, the last token computed: 192 of 200 tokens in blocks of 16.
    block_size = int(profile.settings["prefill.block_size"])
    loaded_tokens = (KVCACHE_LENGTH - 1) // block_size * block_size
    moved = sum(kvcache_delta(b, a, BYTES) for b, a in zip(before, after))
    assert moved == (ROUNDS + 1) * loaded_tokens * profile.transfer.kv_bytes_per_token
    assert sum(kvcache_delta(b, a, SECONDS) for b, a in zip(before, after)) > 0
    assert profile.transfer.kvcache_gb_s is not None and profile.transfer.kvcache_gb_s > 0
    assert f"kvcache_gb_s: {profile.transfer.kvcache_gb_s:.3f}" in text
    [point] = profile.kvcache
    assert point.input_tokens == KVCACHE_LENGTH and point.gb_s > 0
    assert point.ttft_hit_ms > 0 and point.ttft_uncached_ms > 0
    by_kvcache = next(line for line in text.splitlines() if line.startswith("kv_bytes_per_token_from_kvcache"))
    assert by_kvcache.split(": ")[1] == str(profile.transfer.kv_bytes_per_token)
    assert out.with_suffix(".png").exists() or out.with_suffix(".txt").exists()
