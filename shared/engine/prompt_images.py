"""A prompt's images as the scheduler, the KV cache and the runner see them: where
each image's placeholder tokens are and what the image is named (the block hashes
carry it), and the prompt's M-RoPE positions. Plain data, no torch: it rides on the
request state and on the step contract.

What a step's positions are follows from the table (shared/model/vision/mrope.py):
a chunk that holds image tokens needs the three rows; any other chunk is one run of
text (an image would have been inside it), whose three positions are equal and a
fixed shift from the sequence positions, so it goes as the 1-D positions shifted.
Past the prompt that shift is the rope delta: decode steps, and so CUDA graphs,
need nothing else.
"""

from dataclasses import dataclass

from shared.kv.block_hash import ImageSpan
from shared.model.vision.mrope import MRopePositions


@dataclass(frozen=True, slots=True)
class ImageRows:
    """The rows of a step chunk that take image embeddings: ``count`` rows from the
    chunk's row ``row``, which are the request's image-token rows from ``first``
    (an index into the request's image tokens, all its images' in order)."""

    row: int
    first: int
    count: int


@dataclass(frozen=True, slots=True)
class PromptImages:
    spans: tuple[ImageSpan, ...]
    """Each image's run of placeholder tokens, in prompt order."""
    positions: MRopePositions

    def __post_init__(self) -> None:
        starts = [s.start for s in self.spans]
        if starts != sorted(starts) or any(a.start + a.length > b.start for a, b in zip(self.spans, self.spans[1:])):
            raise ValueError("image spans must be in prompt order and apart")

    @property
    def num_image_tokens(self) -> int:
        return sum(s.length for s in self.spans)

    def image_rows(self, start: int, end: int) -> list[ImageRows]:
        """The image-token rows among sequence positions [start, end), per image."""
        out: list[ImageRows] = []
        before = 0  # image tokens of the images before this one
        for span in self.spans:
            lo, hi = max(start, span.start), min(end, span.start + span.length)
            if lo < hi:
                out.append(ImageRows(lo - start, before + lo - span.start, hi - lo))
            before += span.length
        return out

    def overlaps(self, start: int, end: int) -> bool:
        return any(s.start < end and start < s.start + s.length for s in self.spans)

    def rope_shift(self, start: int) -> int:
        """For a chunk from ``start`` that holds no image token: its rotary positions are
        its sequence positions plus this, on all three axes."""
        table = self.positions.table[0]
        return table[start] - start if start < len(table) else self.positions.delta

    def rope_rows(self, start: int, end: int) -> list[list[int]]:
        """[3][end - start]: the rotary positions of sequence positions [start, end)."""
        return self.positions.rows(start, end)
