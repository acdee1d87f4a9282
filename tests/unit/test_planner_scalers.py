"""Where the planner's decisions go: `infermesh up`'s replicas file (read back as
the supervisor reads it) and the Kubernetes scale subresource (against a local HTTP
server that answers as the API server's scale endpoint does, so the request's
verb, path, patch type and bearer token are checked, and errors surface)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from services.planner.scalers import KubernetesScaler, ReplicasFileScaler, ScaleError
from shared.runtime.desired_replicas import read_desired, write_desired


def test_the_replicas_file_keeps_the_stages_not_named(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "replicas.json"
    scaler = ReplicasFileScaler(path, started_with={"prefill": 1, "decode": 2})
    assert scaler.current() == {"prefill": 1, "decode": 2}
    scaler.scale({"decode": 4})
    assert read_desired(path) == {"prefill": 1, "decode": 4}
    scaler.scale({"prefill": 3})
    assert scaler.current() == {"prefill": 3, "decode": 4}


def test_a_bad_replicas_file_is_refused_by_name(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="kvcache"):
        write_desired(tmp_path / "r.json", {"kvcache": 2})
    with pytest.raises(ValueError, match=">= 0"):
        write_desired(tmp_path / "r.json", {"decode": -1})
    (tmp_path / "r.json").write_text('{"decode": "two"}')
    with pytest.raises(ValueError, match="decode"):
        read_desired(tmp_path / "r.json")
    with pytest.raises(ScaleError):
        ReplicasFileScaler(tmp_path / "r.json").current()


class ScaleAPI(BaseHTTPRequestHandler):
    replicas: dict[str, int] = {}
    seen: list[tuple[str, str, str, str]] = []

    def _name(self) -> str | None:
        """The StatefulSet of /apis/apps/v1/namespaces/mesh/statefulsets/<name>/scale, else None."""
        parts = self.path.split("/")
        if parts[:7] == ["", "apis", "apps", "v1", "namespaces", "mesh", "statefulsets"] and parts[8:] == ["scale"]:
            return parts[7]
        return None

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        self.seen.append((self.command, self.path, self.headers.get("Content-Type", ""),
                          self.headers.get("Authorization", "")))
        name = self._name()
        if self.headers.get("Authorization") != "Bearer t0ken":
            return self._answer(401, {"kind": "Status", "message": "Unauthorized"})
        if name not in self.replicas:
            return self._answer(404, {"kind": "Status", "message": f"statefulsets {name!r} not found"})
        if self.command == "PATCH":
            patch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.replicas[name] = patch["spec"]["replicas"]
        self._answer(200, {"kind": "Scale", "spec": {"replicas": self.replicas[name]}})

    do_GET = do_PATCH = _handle

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass


@pytest.fixture
def api():  # noqa: ANN201
    ScaleAPI.replicas = {"im-prefill": 1, "im-decode": 2}
    ScaleAPI.seen = []
    server = HTTPServer(("127.0.0.1", 0), ScaleAPI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_kubernetes_scale_subresource(api) -> None:  # noqa: ANN001
    scaler = KubernetesScaler({"prefill": "im-prefill", "decode": "im-decode"}, "mesh", api_url=api, token="t0ken")
    assert scaler.current() == {"prefill": 1, "decode": 2}
    scaler.scale({"decode": 5})
    assert ScaleAPI.replicas == {"im-prefill": 1, "im-decode": 5}
    method, path, content_type, auth = ScaleAPI.seen[-1]
    assert (method, path) == ("PATCH", "/apis/apps/v1/namespaces/mesh/statefulsets/im-decode/scale")
    assert content_type == "application/merge-patch+json" and auth == "Bearer t0ken"
    with pytest.raises(ScaleError, match="vision"):
        scaler.scale({"vision": 1})


def test_kubernetes_errors_name_the_call(api) -> None:  # noqa: ANN001
    wrong = KubernetesScaler({"decode": "im-decode"}, "mesh", api_url=api, token="nope")
    with pytest.raises(ScaleError, match="HTTP 401"):
        wrong.current()
    missing = KubernetesScaler({"decode": "im-gone"}, "mesh", api_url=api, token="t0ken")
    with pytest.raises(ScaleError, match="HTTP 404.*im-gone"):
        missing.scale({"decode": 2})
