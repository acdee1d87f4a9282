import subprocess
import sys

from shared.kv.block_hash import ROOT_HASH, hash_block, hash_block_chain


def test_chain_covers_full_blocks_only_and_depends_on_parent():
    tokens = list(range(10))
    hashes = hash_block_chain(tokens, 4, "fp")
    assert len(hashes) == 2  # the trailing 2 tokens make no full block
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    # The same tokens behind a different first block hash differently.
    other = hash_block_chain([99] + tokens[1:], 4, "fp")
    assert other[1] != hashes[1]


def test_extra_keys_separate_models_and_tenants():
    tokens = list(range(8))
    base = hash_block_chain(tokens, 4, "model-a")
    assert hash_block_chain(tokens, 4, "model-b")[0] != base[0]
    assert hash_block_chain(tokens, 4, "model-a", cache_salt="tenant")[0] != base[0]
    # Extra keys are length-prefixed: ("ab", "c") and ("a", "bc") differ.
    assert hash_block(None, [1], ("ab", "c")) != hash_block(None, [1], ("a", "bc"))


def test_incremental_chain_equals_full_chain():
    tokens = list(range(40))
    full = hash_block_chain(tokens, 8, "fp")
    head = hash_block_chain(tokens[:17], 8, "fp")
    tail = hash_block_chain(tokens, 8, "fp", start=len(head), parent=head[-1])
    assert head + tail == full


def test_hash_is_stable_across_processes():
    code = (
        "from shared.kv.block_hash import hash_block_chain;"
        "print(hash_block_chain(list(range(64)), 16, 'fp', 'salt')[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": "."},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {hash_block_chain(list(range(64)), 16, "fp", "salt")[-1].hex()}
    assert len(ROOT_HASH) == 32


def test_model_fingerprint_tells_seeds_apart(tmp_path):
    from shared.model.fingerprint import model_fingerprint
    from shared.model.make_model import make_model

    make_model(tmp_path / "a", seed=0, tokenizer=False)
    make_model(tmp_path / "b", seed=1, tokenizer=False)
    make_model(tmp_path / "c", seed=0, tokenizer=False)
    fa, fb, fc = (model_fingerprint(tmp_path / n) for n in "abc")
    assert fa == fc and fa != fb
