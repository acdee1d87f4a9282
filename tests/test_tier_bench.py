"""tools/bench/tier_bench: one short run on the CPU (tiny model, kvcache as a real
process), checking that each row's hit came from the tier it is named after and
nowhere else, and that the bench's own checks catch a load that brings wrong KV.
Never a timing threshold."""

import json

import pytest

from shared.engine.host_tier import HostTierConnector
from tools.make_model import make_model
from tools.bench.tier_bench import TIERS, TierBenchError, main, run_tier_bench

PROMPT_LEN, BLOCK = 512, 16
CACHED = int(PROMPT_LEN * 0.9) // BLOCK * BLOCK  # 448: the prefix an earlier request left
BLOCKS = CACHED // BLOCK


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tier-model")
    make_model(path, tokenizer=False)  # token-id prompts
    return str(path)


def test_each_row_hits_its_own_tier_and_matches_cold(model_dir, tmp_path, capsys):
    out = tmp_path / "tiers"
    args = ["--model", model_dir, "--prompt-len", str(PROMPT_LEN), "--repeats", "1", "--warmup", "0", "--out", str(out)]
    assert main(args) == 0
    figures = json.loads((out / "tiers.json").read_text())
    rows = figures["rows"]
    assert list(rows) == list(TIERS) and figures["failures"] == []
    assert figures["config"]["cached_tokens"] == CACHED and figures["config"]["prompt_len"] == PROMPT_LEN
    got = {
        tier: (
            row["num_cached_tokens"],
            row["num_loaded_blocks"],
            row["samples"][0]["host_tier_hit_blocks"],
            row["samples"][0]["kvcache_hit_blocks"],
        )
        for tier, row in rows.items()
    }
    # (cached tokens, blocks loaded through the connector, host tier hits, kvcache hits)
    assert got == {
        "cold": (0, 0, 0, 0),
        "device": (CACHED, 0, 0, 0),  # from the engine's own cache: nothing loaded
        "host": (CACHED, BLOCKS, BLOCKS, 0),  # evicted from the device, served by the host tier alone
        "kvcache": (CACHED, BLOCKS, 0, BLOCKS),  # no host tier: served by kvcache over gRPC
    }
    block_bytes = figures["config"]["block_bytes"]
    assert rows["host"]["loaded_bytes"] == rows["kvcache"]["loaded_bytes"] == BLOCKS * block_bytes
    for tier in ("host", "kvcache"):
        assert rows[tier]["kv_equals_computed"] is True  # byte for byte what the writer computed
    for tier in TIERS:
        assert rows[tier]["first_token_equals_cold"] is True
        assert rows[tier]["ttft_ms"] > 0
    assert rows["cold"]["vs_cold"] == 1.0
    table = (out / "tiers.md").read_text()
    assert "| tier | TTFT ms | vs cold |" in table and all(f"| {tier} |" in table for tier in TIERS)
    assert "| host |" in capsys.readouterr().out


def test_a_load_of_wrong_kv_fails_loudly(model_dir, monkeypatch):
    """The host tier writes two blocks' KV in each other's place: the host row is refused
    (the tiny model's near-uniform attention barely moves the logits, so the byte check
    is what catches it); the kvcache row, loaded right, is not."""
    write = HostTierConnector._write

    def swapped(self, hashes, block_ids):
        # The first two blocks' destinations exchanged: each gets the other's KV.
        ids = {g: [b[1], b[0], *b[2:]] if len(b) > 1 else b for g, b in block_ids.items()}
        return write(self, hashes, ids)

    monkeypatch.setattr(HostTierConnector, "_write", swapped)
    with pytest.raises(TierBenchError, match="host: the loaded prefix KV is not") as failed:
        run_tier_bench(model_dir, prompt_len=PROMPT_LEN, repeats=1, warmup=0)
    assert "kvcache:" not in str(failed.value)
