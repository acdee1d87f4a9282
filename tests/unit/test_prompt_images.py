"""A prompt's images as a step sees them (shared/engine/prompt_images.py and
step_inputs): which rows take embeddings, 3-row positions only for a chunk that holds
image tokens, 1-row positions shifted by the table elsewhere, and the decode graphs'
rows shifted by the rope delta."""

from shared.engine.prompt_images import ImageRows, PromptImages
from shared.engine.step import ScheduledChunk, SchedulerOutput
from shared.engine.step_inputs import graph_rows, rope_positions, step_image_rows
from shared.kv.block_hash import ImageSpan
from shared.model.vision.mrope import mrope_positions

PAD = 9
# text 3, an image of 2x2 merged tokens (4x4 patches), text 2, an image of 1x2 (2x4), text 1.
TOKENS = [1, 2, 3] + [PAD] * 4 + [4, 5] + [PAD] * 2 + [6]
GRIDS = [(1, 4, 4), (1, 2, 4)]


def _images() -> PromptImages:
    positions = mrope_positions(TOKENS, GRIDS, PAD, 2)
    return PromptImages((ImageSpan(b"x", 3, 4), ImageSpan(b"y", 9, 2)), positions)


def _chunk(rid: str, start: int, n: int) -> ScheduledChunk:
    return ScheduledChunk(rid, [0] * n, start, [[0, 1, 2, 3]], sample=True)


def test_rows_and_positions_of_chunks():
    im = _images()
    # Table: text 0,1,2; image at 3 (h 3..4, w 3..4); text continues at 5: positions 7,8 -> 5,6;
    # image at 7 (h 7, w 7..8); text at 9 -> position 11 (delta 9 - 12 + 1 = -2).
    assert im.positions.delta == -2
    assert im.image_rows(0, 3) == []
    assert im.image_rows(2, 10) == [ImageRows(1, 0, 4), ImageRows(7, 4, 1)]
    assert im.rope_shift(0) == 0 and im.rope_shift(7) == -2 and im.rope_shift(12) == -2
    # Text only between the images (positions 7..8): one row, shifted.
    assert rope_positions([_chunk("r", 7, 2)], {"r": im}) == ([5, 6], 1)
    # A decode step past the prompt, beside a text request: one row, the delta.
    assert rope_positions([_chunk("r", 12, 1), _chunk("t", 5, 1)], {"r": im}) == ([10, 5], 1)
    # A chunk over an image: three rows, the text request's alike on every axis.
    flat, axes = rope_positions([_chunk("t", 5, 1), _chunk("r", 2, 3)], {"r": im})
    assert axes == 3
    assert [flat[0:4], flat[4:8], flat[8:12]] == [[5, 2, 3, 3], [5, 2, 3, 3], [5, 2, 3, 4]]
    assert step_image_rows([_chunk("t", 5, 1), _chunk("r", 2, 3)], {"r": im}) == [("r", ImageRows(2, 0, 2))]


def test_graph_rows_shift_past_the_images():
    sched = SchedulerOutput(chunks=[_chunk("r", 12, 1), _chunk("t", 5, 1)])
    rows = graph_rows(sched, 4, 1, {}, {"r": _images().rope_shift(12)})
    assert rows.positions == [10, 5]
    assert rows.seq_lens == [13, 6]  # the KV positions are the sequence's, unshifted
