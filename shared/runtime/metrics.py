"""Prometheus metrics under one naming scheme: infermesh_<stage>_<name>.
Each service owns a registry (no process-global state) served on /metrics,
beside /health (the process answers: liveness) and /ready (it should get work:
readiness), for probes that speak HTTP only."""

import json
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

# Latency buckets that span a CPU test model and a GPU deployment, up to 10 minutes
# (a long generation, or a request queued behind many).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

Readiness = Callable[[], str | None]
"""None when the service should get work, else why not (said in /ready's 503)."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scrape never holds the process at exit


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base class's name)
        pass  # probes every few seconds would drown the service's log


class Metrics:
    def __init__(self, stage: str) -> None:
        self.prefix = f"infermesh_{stage}_"
        self.registry = CollectorRegistry()
        self._server: _Server | None = None
        self._readiness: Readiness = lambda: "starting"  # until the service says what ready means
        self.has_readiness = False

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(self.prefix + name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(self.prefix + name, doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(self.prefix + name, doc, registry=self.registry, buckets=buckets)

    def set_readiness(self, readiness: Readiness) -> None:
        """What /ready asks from now on (called on the server's threads: keep it a read of flags)."""
        self._readiness = readiness
        self.has_readiness = True

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve /metrics, /health and /ready on a thread; returns the bound port (port 0 picks one)."""
        metrics_app = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "")
            if path == "/health":
                return _json(start_response, 200, {"status": "alive"})
            if path == "/ready":
                try:
                    reason = self._readiness()
                except Exception as exc:  # a readiness check that fails says so, never 200
                    reason = f"readiness check failed: {type(exc).__name__}"
                if reason is None:
                    return _json(start_response, 200, {"ready": True})
                return _json(start_response, 503, {"ready": False, "reason": reason})
            return metrics_app(environ, start_response)

        class Server(_Server):  # the family is per server, not a global of the class
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        server = make_server(host, port, app, Server, handler_class=_Quiet)
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        self._server = server
        return server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def _json(start_response: Callable[..., Any], status: int, body: dict[str, Any]) -> list[bytes]:
    data = json.dumps(body).encode()
    reason = {200: "OK", 503: "Service Unavailable"}[status]
    start_response(f"{status} {reason}", [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
    return [data]
