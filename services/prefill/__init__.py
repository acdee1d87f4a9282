"""The prefill stage: computes the uncached part of a prompt, stores its full
KV blocks in the kvcache service, samples the first token and hands the
request to the decode instance the balancer chose."""
