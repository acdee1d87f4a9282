"""The committed default model pair (models/trained, made by tools/train/default_model.py):
small enough to live in the repository, loadable by the engine, and the engine's
greedy continuation of Python code is transformers' for the same weights."""

import json
from pathlib import Path

import torch

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.recipe import Recipe

ROOT = Path(__file__).resolve().parents[2] / "models" / "trained"


def test_the_pair_fits_the_repository_and_shares_one_tokenizer():
    total = sum(f.stat().st_size for f in ROOT.rglob("*") if f.is_file())
    assert total <= 25 << 20
    assert (ROOT / "target" / "tokenizer.json").read_bytes() == (ROOT / "draft" / "tokenizer.json").read_bytes()
    record = json.loads((ROOT / "training.json").read_text())
    # The held-out loss is recorded and the target learned more than the draft.
    assert record["target"]["heldout_loss"] < record["draft"]["heldout_loss"] < record["target"]["curve"][0]["heldout_loss"]


def test_the_engine_continues_python_as_transformers_does():
    from transformers import AutoModelForCausalLM

    target = ROOT / "target"
    prompt = "import os\n\n\ndef read_lines(path):\n"
    ids = Recipe.from_pretrained(str(target)).encode(prompt, add_special_tokens=False)
    llm = LLM(str(target), dtype="float32", block_size=16)
    got = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    expected = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert got == expected
    text = Recipe.from_pretrained(str(target)).decode(got)
    assert any(word in text for word in ("return", "if ", "self", "os.", "(")), text
