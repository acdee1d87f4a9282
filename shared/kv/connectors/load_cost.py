"""Whether loading a prefix from kvcache beats recomputing it.

kvcache is a store over gRPC and LMDB: on the H200 it delivers ~0.3-0.5 GB/s,
while an 8B model recomputes the same KV at ~4.5 GB/s (a 4k-token prefix comes
back in ~1.5 s and is recomputed in ~0.13 s). On a CPU the balance is the other
way round. So each worker measures both and loads a hit only when the load is
expected to take no longer than LOAD_SLOWDOWN_LIMIT times the recompute:

  load      bytes / the bandwidth its own loads achieved (a running average);
  recompute tokens / the engine's prefill rate, measured once when it starts
            (KVConnector.register_recompute_rate).

Until one load was measured, or without a prefill rate, a hit is loaded: the
first load is how the bandwidth gets known. A hit declined is the outcome
"recompute" (take_outcome, the span's kv.kvcache, kvcache_bypassed_total).
"""

import threading
from dataclasses import dataclass, field

LOAD_SLOWDOWN_LIMIT = 2.0
"""A load may take up to this many times the recompute's time and still be taken:
it uses no compute (the engine serves other requests meanwhile), recomputing does."""
EMA = 0.2
"""Weight of the newest load in the bandwidth's running average."""


@dataclass
class LoadCost:
    recompute_tokens_per_s: float | None = None
    bytes_per_s: float | None = None
    """The bandwidth of this worker's loads from kvcache (None before the first)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe_load(self, num_bytes: int, seconds: float) -> None:
        """A load finished (on the connector's thread)."""
        if num_bytes <= 0 or seconds <= 0:
            return
        rate = num_bytes / seconds
        with self._lock:
            old = self.bytes_per_s
            self.bytes_per_s = rate if old is None else old + EMA * (rate - old)

    def worth_loading(self, num_blocks: int, block_bytes: int, block_tokens: int) -> bool:
        with self._lock:
            bandwidth = self.bytes_per_s
        if bandwidth is None or not self.recompute_tokens_per_s or num_blocks <= 0:
            return True
        load_s = num_blocks * block_bytes / bandwidth
        recompute_s = num_blocks * block_tokens / self.recompute_tokens_per_s
        return load_s <= LOAD_SLOWDOWN_LIMIT * recompute_s
