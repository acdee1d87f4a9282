"""The unit tier (marker `unit`): tests that run in this process on the CPU with exact
assertions (the scheduler, the KV coordinator, the sampler, the routing policies, the
APIs over an in-process engine, the layering). Run first, and fail fast."""
