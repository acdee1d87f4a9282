"""Every outside source and sink of an engine's KV, behind one interface
(base.py), one file each: a store in this process's memory (memory.py), the
kvcache service (kvcache.py, with its writer process kvcache_writer.py and its
load-or-recompute estimate load_cost.py), the host-memory tier (host_tier.py)
and the direct copy out of a peer's cache (peer.py). chain.py orders them for a
mesh worker: peer -> host tier -> kvcache."""
