"""Route: the instances one attempt was handed to (the same one twice when its
decode instance computes the prompt itself)."""

import dataclasses


@dataclasses.dataclass(slots=True, frozen=True)
class Route:
    prefill: str
    decode: str

    @property
    def local(self) -> bool:
        """The decode instance prefills the prompt too (conditional disaggregation)."""
        return self.prefill == self.decode
