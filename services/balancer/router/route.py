"""Route: the instances one attempt was handed to (the same one twice when its
decode instance computes the prompt itself)."""

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(slots=True, frozen=True)
class Route:
    prefill: str
    decode: str
    prefilled: Callable[[], None] = dataclasses.field(default=lambda: None, compare=False, repr=False)
    """Call once the prompt is computed (decode's first chunk): counts the load reserved
    on the prefill instance off (reservations.py)."""

    @property
    def local(self) -> bool:
        """The decode instance prefills the prompt too (conditional disaggregation)."""
        return self.prefill == self.decode
