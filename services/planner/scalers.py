"""Where the live planner's decisions go: one Scaler per way the mesh is run.

- `AdvisoryScaler`: publishes only (the planner's metrics and log say what it
  would do); the operator, or an HPA, acts.
- `ReplicasFileScaler`: `infermesh up`'s supervisor, through the replicas file
  in its state directory (shared/runtime/desired_replicas.py).
- `KubernetesScaler`: each stage's StatefulSet, through the API server's scale
  subresource (PATCH .../statefulsets/<name>/scale), with the pod's service
  account token; the chart's Role grants exactly get and patch on those.

Every scaler reads the current counts back, so a planner restarted mid-way (or
a person who scaled by hand) is seen, not overwritten blindly.
"""

import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from shared.runtime.desired_replicas import read_desired, write_desired

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ScaleError(RuntimeError):
    """The replicas could not be read or set; the planner logs it and tries next interval."""


class Scaler(Protocol):
    acts: bool
    """False: decisions are published, never applied."""

    def current(self) -> dict[str, int]:
        """Each scalable stage's replica count as the deployment has it now."""
        ...

    def scale(self, replicas: dict[str, int]) -> None:
        """Set the stages named to their counts."""
        ...


@dataclass
class AdvisoryScaler:
    """Acts on nothing; remembers what it was told, as the counts to plan from
    (seeded from the live registry by the planner)."""

    counts: dict[str, int] = field(default_factory=dict)
    acts: bool = False

    def current(self) -> dict[str, int]:
        return dict(self.counts)

    def scale(self, replicas: dict[str, int]) -> None:
        self.counts.update(replicas)


@dataclass
class ReplicasFileScaler:
    """`infermesh up`'s supervisor: it starts or drains instances to the file's counts."""

    path: Path
    started_with: dict[str, int] = field(default_factory=dict)
    """The counts up started with (before any file): what current() reports for a stage the file does not name."""
    acts: bool = True

    def current(self) -> dict[str, int]:
        try:
            return {**self.started_with, **read_desired(self.path)}
        except ValueError as exc:
            raise ScaleError(str(exc)) from None

    def scale(self, replicas: dict[str, int]) -> None:
        write_desired(self.path, {**self.current(), **replicas})


@dataclass
class KubernetesScaler:
    """The StatefulSet of each stage, by name (the chart's <fullname>-<stage>)."""

    statefulsets: dict[str, str]
    """stage -> StatefulSet name."""
    namespace: str
    api_url: str = "https://kubernetes.default.svc"
    token: str = ""
    ca_file: str | None = None
    timeout_s: float = 5.0
    acts: bool = True

    @classmethod
    def in_cluster(cls, statefulsets: dict[str, str], namespace: str = "") -> "KubernetesScaler":
        """With the pod's service account (token, CA and namespace where Kubernetes mounts them)."""
        try:
            token = (SERVICE_ACCOUNT / "token").read_text().strip()
            namespace = namespace or (SERVICE_ACCOUNT / "namespace").read_text().strip()
        except OSError as exc:
            raise ScaleError(f"no service account in this pod ({exc}): the kubernetes backend runs in a cluster") from None
        return cls(statefulsets, namespace, token=token, ca_file=str(SERVICE_ACCOUNT / "ca.crt"))

    def _url(self, stage: str) -> str:
        name = self.statefulsets[stage]
        return f"{self.api_url}/apis/apps/v1/namespaces/{self.namespace}/statefulsets/{name}/scale"

    def _call(self, method: str, url: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Accept", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        if body is not None:
            req.add_header("Content-Type", "application/merge-patch+json")
        context = ssl.create_default_context(cafile=self.ca_file) if url.startswith("https") else None
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=context) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise ScaleError(f"{method} {url}: HTTP {exc.code}: {detail}") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ScaleError(f"{method} {url}: {exc}") from None

    def current(self) -> dict[str, int]:
        return {stage: int(self._call("GET", self._url(stage)).get("spec", {}).get("replicas", 0))
                for stage in self.statefulsets}

    def scale(self, replicas: dict[str, int]) -> None:
        for stage, count in replicas.items():
            if stage not in self.statefulsets:
                raise ScaleError(f"no StatefulSet named for stage {stage!r} (known: {', '.join(self.statefulsets)})")
            self._call("PATCH", self._url(stage), {"spec": {"replicas": count}})
