"""Container health check, the same probe Kubernetes makes natively:

    python deploy/docker/healthcheck.py grpc 127.0.0.1:50061   # grpc.health.v1 says SERVING
    python deploy/docker/healthcheck.py http http://127.0.0.1:8000/ready   # answers 200

Exit status 0 when healthy, 1 when not (docker-compose healthchecks read it).
Standard library plus grpcio-health-checking, which the image already has; no
project import, so it starts fast and works while a service is still loading.

Under mutual TLS (the container's INFERMESH_WORKER__TLS_CERT, _KEY and _CA, as
Helm sets them) the gRPC check presents the container's own certificate: the
server takes no client without one, and kubelet's native gRPC probe has none.
"""

import os
import sys
import urllib.request
from pathlib import Path

TLS_VARIABLES = ("INFERMESH_WORKER__TLS_CA", "INFERMESH_WORKER__TLS_KEY", "INFERMESH_WORKER__TLS_CERT")


def _channel(address: str):  # noqa: ANN202
    import grpc

    paths = [os.environ.get(name) for name in TLS_VARIABLES]
    if not all(paths):
        return grpc.insecure_channel(address)
    ca, key, cert = (Path(path).read_bytes() for path in paths)  # type: ignore[arg-type]
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.secure_channel(address, credentials)


def grpc_serving(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with _channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as exc:
        print(f"{address}: {exc.code().name}", file=sys.stderr)
        return False
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}", file=sys.stderr)
        return False
    return True


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError as exc:  # URLError and HTTPError (a 503 from /ready) are OSErrors
        print(f"{url}: {exc}", file=sys.stderr)
        return False


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("grpc", "http"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "grpc":
        return 0 if grpc_serving(argv[1], *argv[2:3]) else 1
    return 0 if http_ok(argv[1]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
