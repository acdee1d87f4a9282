"""Every outside source and sink of an engine's KV, behind one interface
(base.py), one file each: a store in this process's memory (memory.py), the
kvcache service (kvcache.py, with its writer process kvcache_writer.py and its
load-or-recompute estimate load_cost.py), the host-memory tier (host_tier.py),
the direct copy out of a peer's cache mapped into this process (peer.py) and the
read of a peer's cache through NIXL (nixl.py), those two over what they share
(peer_link.py: leases, the copy thread, polling). chain.py orders them for a
mesh worker: peer -> NIXL -> host tier -> kvcache."""
