"""python -m services.planner: the live planner (service.py).

Settings (env var INFERMESH_PLANNER__<FIELD>, see shared/runtime/settings.py's
PlannerSettings): profile, interval_s, metrics_url, ttft_ms, itl_ms, percentile,
backend (advisory | up | kubernetes), replicas_file, statefulsets, namespace,
gpu_budget, min_replicas, max_replicas, gpu_hour_usd; worker.metrics_port and
worker.bind_host for its own /metrics.

It logs in to no NATS: it reads the balancer's HTTP /metrics and writes to its
scaler. Its Kubernetes backend uses the pod's service account, which the chart
grants get and patch on the stages' statefulsets/scale only.
"""

import asyncio
import json
import logging
import urllib.error
import urllib.request
from contextlib import AsyncExitStack
from pathlib import Path

from services.planner.profile import Profile
from services.planner.scalers import AdvisoryScaler, KubernetesScaler, ReplicasFileScaler, Scaler
from services.planner.service import LivePlanner
from shared.runtime.service import ServiceContext, main
from shared.runtime.settings import PlannerSettings, Settings

log = logging.getLogger(__name__)
BACKENDS = ("advisory", "up", "kubernetes")


def metrics_url(settings: Settings) -> str:
    return settings.planner.metrics_url or f"http://{settings.balancer.host}:{settings.balancer.port}/metrics"


def live_counts(url: str) -> dict[str, int]:
    """Each stage's live instances, from the balancer's /ready (beside its /metrics)."""
    ready = url.rsplit("/", 1)[0] + "/ready"
    try:
        with urllib.request.urlopen(ready, timeout=5) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 503: not ready, still says what it has
        body = json.loads(exc.read())
    return {stage: int(n) for stage, n in body.get("instances", {}).items()}


def make_scaler(p: PlannerSettings, url: str) -> Scaler:
    if p.backend not in BACKENDS:
        raise ValueError(f"planner.backend {p.backend!r}: one of {', '.join(BACKENDS)}")
    if p.backend == "kubernetes":
        pairs = [item.split("=", 1) for item in p.statefulsets.split(",") if item]
        if not pairs or any(len(pair) != 2 for pair in pairs):
            raise ValueError(f"planner.statefulsets {p.statefulsets!r}: stage=name pairs, comma-separated")
        return KubernetesScaler.in_cluster(dict(pairs), p.namespace)  # type: ignore[arg-type]
    counts = live_counts(url)
    if p.backend == "up":
        if not p.replicas_file:
            raise ValueError("planner.backend up needs planner.replicas_file (<state_dir>/replicas.json)")
        return ReplicasFileScaler(Path(p.replicas_file), started_with=counts)
    return AdvisoryScaler(counts)


async def setup(ctx: ServiceContext, stack: AsyncExitStack) -> None:
    p = ctx.settings.planner
    if not p.profile:
        raise ValueError("planner.profile: the planner needs the stage profile `infermesh profile` wrote")
    profile = Profile.load(p.profile)
    p.metrics_url = metrics_url(ctx.settings)
    planner = LivePlanner(p, profile, make_scaler(p, p.metrics_url), ctx.metrics)
    log.info("planning %s every %g s for TTFT p%g <= %g ms and ITL <= %g ms (backend %s, profile of %s on %s)",
             "prefill, decode" + (" and vision (where deployed)" if profile.vision else ""), p.interval_s,
             p.percentile, p.ttft_ms, p.itl_ms, p.backend, profile.model, profile.device)
    task = asyncio.create_task(planner.run(ctx.stop), name="planner")
    stack.callback(task.cancel)


if __name__ == "__main__":
    main("planner", setup, nats=False, grpc_server=False)
