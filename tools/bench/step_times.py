"""Each engine step's wall time, by the depth the speculator drafted to (0: a plain step).

A speculating engine that is slower than a plain one can lose the time in a few
drafting steps (probes, trials, a graph captured on the way) or a little in every
plain step; the totals by depth tell which. Wraps ``engine.step`` on the instance
(``detach`` puts the method back)."""

import time
from collections import defaultdict

from shared.engine.llm import LLM
from shared.engine.outputs import RequestOutput


class StepTimes:
    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self._inner = llm.engine.step
        self.by_depth: dict[int, list[float]] = defaultdict(list)
        """Per depth, each step's milliseconds."""
        self.engine.step = self  # type: ignore[method-assign]

    def __call__(self) -> list[RequestOutput]:
        start = time.perf_counter()
        out = self._inner()
        speculator = self.engine.speculator
        depth = speculator.depth if speculator is not None else 0
        self.by_depth[depth].append((time.perf_counter() - start) * 1e3)
        return out

    def detach(self) -> None:
        del self.engine.step  # the class's bound method again

    def drafting_ms(self) -> float:
        return sum(sum(v) for d, v in self.by_depth.items() if d)

    def report(self) -> str:
        return "; ".join(
            f"depth {d}: {len(v)} steps, {sum(v):.1f} ms, mean {sum(v) / len(v):.3f}, max {max(v):.2f}"
            for d, v in sorted(self.by_depth.items())
        )
