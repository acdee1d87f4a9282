"""Container health check, the same probe Kubernetes makes natively:

    python deploy/docker/healthcheck.py grpc 127.0.0.1:50061   # grpc.health.v1 says SERVING
    python deploy/docker/healthcheck.py http http://127.0.0.1:8000/ready   # answers 200

Exit status 0 when healthy, 1 when not (docker-compose healthchecks read it).
Standard library plus grpcio-health-checking, which the image already has; no
project import, so it starts fast and works while a service is still loading.
"""

import sys
import urllib.request


def grpc_serving(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
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
