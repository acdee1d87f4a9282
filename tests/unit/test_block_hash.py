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


# Golden values. Changing how a block is hashed (token packing, extra keys, the
# chain) changes these, orphans every block stored in every kvcache and makes
# every process that has not been upgraded disagree with the others: such a
# change must bump ROOT_HASH's version string, and then these values with it.
GOLDEN_ROOT = "bc03b50d816a91322dc72d0482db0a1e29e4d577efe09c31428e3939e64f9a7d"
GOLDEN_CHAIN = (  # hash_block_chain(range(64), 16, "fp", "salt"): first and last block
    "b972d776a1af53c9bbe49015015b9cde2a821e9a26c789ee5b1bca3904fdcc84",
    "b828b75ef7d08fe27789081ead8e30ae27769222f3e44a4e633704d2df0e7692",
)
GOLDEN_EXTRA_KEYS = "c0b5f1f63e61e8f49a0f3cd6cfb6656cc992fd1fb242b4adf6ba83bde1ef8791"


def test_hashes_equal_the_golden_values():
    assert ROOT_HASH.hex() == GOLDEN_ROOT
    chain = hash_block_chain(list(range(64)), 16, "fp", "salt")
    assert (chain[0].hex(), chain[-1].hex()) == GOLDEN_CHAIN
    # Every kind of extra key, and a token id at the top of uint32.
    assert hash_block(None, [1, 2**32 - 1], ("s", b"b", 7)).hex() == GOLDEN_EXTRA_KEYS


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
    from tools.make_model import make_model

    make_model(tmp_path / "a", seed=0, tokenizer=False)
    make_model(tmp_path / "b", seed=1, tokenizer=False)
    make_model(tmp_path / "c", seed=0, tokenizer=False)
    fa, fb, fc = (model_fingerprint(tmp_path / n) for n in "abc")
    assert fa == fc and fa != fb


def test_image_keys_name_the_blocks_an_image_touches():
    """Two prompts of equal ids (one placeholder id per image token) but different
    images part at the first block that holds image tokens; the blocks before agree, and
    each block carries its offset in the image, so blocks 16..31 of an image are not 0..15."""
    from shared.kv.block_hash import ImageSpan, image_extra_keys

    tokens = [7] * 6 + [500] * 20 + [8] * 10  # an image's 20 tokens at positions 6..25
    a, b = ImageSpan(b"a" * 32, 6, 20), ImageSpan(b"b" * 32, 6, 20)
    plain = hash_block_chain(tokens, 4, "fp")
    with_a = hash_block_chain(tokens, 4, "fp", images=[a])
    with_b = hash_block_chain(tokens, 4, "fp", images=[b])
    assert with_a[0] == with_b[0] == plain[0]  # positions 0..3: before the image
    assert all(x != y for x, y in zip(with_a[1:], with_b[1:]))  # from block 1 (4..7) on
    assert with_a[1] != plain[1]
    assert image_extra_keys([a], 4, 8) == (a.hash, 0)
    assert image_extra_keys([a], 8, 12) == (a.hash, 2)
    assert image_extra_keys([a], 24, 28) == (a.hash, 18)
    assert image_extra_keys([a], 26, 30) == ()
    # The chain extended block by block names the blocks as the whole chain does.
    head = hash_block_chain(tokens[:13], 4, "fp", images=[a])
    assert head + hash_block_chain(tokens, 4, "fp", start=3, parent=head[-1], images=[a]) == with_a
