"""The draft-model drafter alone (issue 13): its drafts are the draft model's greedy
tokens and its confidences their probabilities, as transformers computes them, on a
first proposal and on the next one after the context moved on (accepted drafts and a
correction: the drafter recomputes from the first token its cache does not hold).
Its passes are launched back to back with the drafted tokens left on the device, so a
wrong placeholder row, position or catch-up shows here as another token."""

from pathlib import Path

import pytest
import torch

from shared.engine.spec.draft_model import DraftModelDrafter
from shared.model.loader import load_model

DRAFT = Path(__file__).resolve().parents[2] / "models" / "trained" / "draft"
transformers = pytest.importorskip("transformers")


def _reference(hf, context: list[int], tokens: tuple[int, ...]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their probabilities after `context`, teacher-forced on `tokens`."""
    with torch.inference_mode():
        probs = torch.softmax(hf(torch.tensor([context + list(tokens[:-1])])).logits[0, len(context) - 1 :], -1)
    return probs.argmax(-1).tolist(), probs.max(-1).values.tolist()


def test_drafts_are_the_draft_models_greedy_tokens_and_probabilities() -> None:
    model = load_model(str(DRAFT), dtype=torch.float32, device="cpu", kernels="torch")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DRAFT), dtype=torch.float32).eval()
    drafter = DraftModelDrafter(model, 16, 64, torch.float32, torch.device("cpu"), cuda_graphs=False)
    contexts = {"a": [5, 9, 13, 9, 13, 21, 40], "b": [100, 200, 300, 7, 8]}
    first = drafter.propose(contexts, 4)
    moved = {"a": contexts["a"] + list(first["a"].tokens[:2]) + [77], "b": contexts["b"] + [3]}
    second = drafter.propose(moved, 3)
    for context, draft in [(contexts["a"], first["a"]), (contexts["b"], first["b"]),
                           (moved["a"], second["a"]), (moved["b"], second["b"])]:  # fmt: skip
        tokens, probs = _reference(hf, context, draft.tokens)
        assert list(draft.tokens) == tokens
        assert draft.draft_probs is not None
        assert max(abs(a - b) for a, b in zip(draft.draft_probs, probs)) < 1e-4
    assert len(first["a"].tokens) == 4 and len(second["a"].tokens) == 3
