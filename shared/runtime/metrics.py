"""Prometheus metrics under one naming scheme: infermesh_<stage>_<name>.
Each service owns a registry (no process-global state) served on /metrics."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Latency buckets that span a CPU test model and a GPU deployment, up to 10 minutes
# (a long generation, or a request queued behind many).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self, stage: str) -> None:
        self.prefix = f"infermesh_{stage}_"
        self.registry = CollectorRegistry()
        self._server = None

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(self.prefix + name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(self.prefix + name, doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(self.prefix + name, doc, registry=self.registry, buckets=buckets)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve /metrics on a thread; returns the bound port (port 0 picks one)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
