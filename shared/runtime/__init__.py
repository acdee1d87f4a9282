"""The plumbing every service shares: settings, NATS bus, gRPC helpers,
telemetry, metrics and the service skeleton. No engine code: the settings nest
the engine's plain-data EngineConfig, the kvcache wire is shared/kv/wire, and
the engine-stage skeleton is shared/stage. No service rewrites these."""
