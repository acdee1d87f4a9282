"""The plumbing every service shares: settings, NATS bus, gRPC helpers,
telemetry, metrics, the service skeleton, and the kvcache client (with the
block stream it shares with the kvcache service). No engine code: the settings
nest the engine's plain-data EngineConfig, and the engine-stage skeleton is
shared/stage. No service rewrites these."""
