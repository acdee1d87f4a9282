"""A speculating worker's series: vLLM v1's spec_decode counters (same names and
labels, so its dashboards' acceptance panels work), plus the mesh's own figures
that vLLM leaves to PromQL: the mean accepted length, the drafting depth the
schedule chose, and the requests that decoded without speculation, by reason.

Only an engine with speculation on creates them (vLLM exports no spec_decode
series when speculation is off either)."""

from prometheus_client import Counter

from shared.engine.outputs import EngineLoad
from shared.runtime.metrics import Metrics
from shared.runtime.vllm_metrics import MODEL_NAME, counter


class SpecMetrics:
    def __init__(self, metrics: Metrics, model_name: str, num_positions: int) -> None:
        r, m = metrics.registry, model_name
        self._model = m
        self.drafts = counter(r, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", m)
        self.draft_tokens = counter(r, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", m)
        self.accepted = counter(r, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", m)
        self.accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            (MODEL_NAME, "position"),
            registry=r,
        )
        for position in range(num_positions):  # every position shows from the start, at 0
            self.accepted_per_pos.labels(m, str(position))
        self.mean_accepted_length = metrics.gauge(
            "spec_mean_accepted_length",
            "Tokens emitted per verification since start (accepted drafts plus the bonus or correction)",
        )
        self.fallbacks = metrics.counter(
            "spec_fallbacks", "Requests (or steps) that decoded without speculation, by reason", ("reason",)
        )
        self._last: EngineLoad | None = None

    def update(self, load: EngineLoad) -> None:
        """Counters by what the load's running totals grew since the last load."""
        last = self._last
        self.drafts.inc(load.num_spec_verifications - (last.num_spec_verifications if last else 0))
        self.draft_tokens.inc(load.num_spec_drafted_tokens - (last.num_spec_drafted_tokens if last else 0))
        self.accepted.inc(load.num_spec_accepted_tokens - (last.num_spec_accepted_tokens if last else 0))
        before = (last.spec_accepted_by_position if last else None) or []
        for position, total in enumerate(load.spec_accepted_by_position or []):
            grew = total - (before[position] if position < len(before) else 0)
            if grew:
                self.accepted_per_pos.labels(self._model, str(position)).inc(grew)
        before_fallbacks = (last.spec_fallbacks if last else None) or {}
        for reason, total in (load.spec_fallbacks or {}).items():
            grew = total - before_fallbacks.get(reason, 0)
            if grew:
                self.fallbacks.labels(reason).inc(grew)
        self.mean_accepted_length.set(load.mean_accepted_length)
        self._last = load
