"""The plumbing every service shares: settings, NATS bus, gRPC helpers,
telemetry, metrics and the service skeleton. No service rewrites these."""
