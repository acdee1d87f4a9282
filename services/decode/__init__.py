"""The decode stage: admits prefilled requests into its continuous batch,
loading their KV blocks from kvcache, and streams their tokens on NATS."""
