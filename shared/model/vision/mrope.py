"""Multimodal rotary positions (M-RoPE, Qwen2-VL / Qwen2.5-VL), torch-free: each prompt
token gets three positions (temporal, height, width), as transformers'
``Qwen2_5_VLModel.get_rope_index`` computes them:

- a text token: all three equal, one more than the token before;
- an image of (t, h, w) patches, i.e. (t, h/m, w/m) merged tokens after the m x m merge,
  starting at position s: token (i, j, k) gets (s + i, s + j, s + k), and the text after
  it continues at s + max(h, w) / m.

So a prompt's positions fall behind its sequence positions by what its images saved:
every token after the prompt (decode) sits at its sequence position plus ``delta``, the
same for all three, which is the ordinary 1-D rope at that position. Only the prompt's
own rows need the table.
"""

from collections.abc import Sequence
from dataclasses import dataclass

GridTHW = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class MRopePositions:
    """One prompt's rotary positions: ``table`` [3][prompt tokens] (temporal, height,
    width), and ``delta``: a token at sequence position p past the prompt is at rotary
    position p + delta on all three axes."""

    table: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    delta: int

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.table[0])

    def rows(self, start: int, end: int) -> list[list[int]]:
        """[3][end - start]: the rotary positions of sequence positions start..end-1."""
        n = self.num_prompt_tokens
        inside = [list(axis[start : min(end, n)]) for axis in self.table]
        after = list(range(max(start, n) + self.delta, end + self.delta))
        return [axis + after for axis in inside]


def mrope_positions(
    token_ids: Sequence[int], grids: Sequence[GridTHW], image_token_id: int, spatial_merge_size: int
) -> MRopePositions:
    """The positions of a prompt whose runs of ``image_token_id`` are its images, in
    order, each of ``t * h * w / merge**2`` tokens (one per row of ``grids``, the
    processor's ``image_grid_thw``). A ValueError where the counts disagree."""
    merge = spatial_merge_size
    counts = [t * (h // merge) * (w // merge) for t, h, w in grids]
    table: tuple[list[int], list[int], list[int]] = ([], [], [])
    pos = 0  # the next text position
    i, image = 0, 0
    n = len(token_ids)
    while i < n:
        if token_ids[i] != image_token_id:
            for axis in table:
                axis.append(pos)
            pos += 1
            i += 1
            continue
        if image == len(grids):
            raise ValueError(f"the prompt has more image tokens than its {len(grids)} images take")
        t, h, w = grids[image]
        count = counts[image]
        run = token_ids[i : i + count]
        if len(run) < count or any(tok != image_token_id for tok in run):
            raise ValueError(f"image {image} ({t}x{h}x{w} patches) needs {count} consecutive image tokens at {i}")
        mh, mw = h // merge, w // merge
        for ti in range(t):
            for hi in range(mh):
                for wi in range(mw):
                    table[0].append(pos + ti)
                    table[1].append(pos + hi)
                    table[2].append(pos + wi)
        pos += max(h, w) // merge
        i += count
        image += 1
    if image != len(grids):
        raise ValueError(f"the prompt's image tokens cover {image} of its {len(grids)} images")
    top = max((max(axis) for axis in table if axis), default=-1)
    return MRopePositions((tuple(table[0]), tuple(table[1]), tuple(table[2])), top + 1 - n)
