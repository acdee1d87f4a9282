"""A planned values file deploys with the chart: it renders, lints clean, and the
stages' StatefulSets carry the plan's replicas and GPUs with no HPA."""

import dataclasses

import helm_python as helm
import yaml

from services.planner.helm_values import helm_values, options_for
from services.planner.plan import Lengths, Targets, Workload, plan
from tests.helpers.deploy_harness import kinds
from tests.helpers.helm_chart import CHART, render_chart
from tools.planner.synthetic_profile import synthetic_profile


def _layered(base: dict, over: dict) -> dict:
    """`helm -f base -f over`: maps merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _layered(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _render(values: dict) -> list[dict]:
    report = helm.lint(CHART, values, strict=True, kube_version="v1.27.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
    return render_chart(values)


def test_planned_values_render_with_the_plans_replicas_and_gpus():
    profile = synthetic_profile()
    planned = plan(profile, Workload(60, Lengths(2000, 4000), Lengths(200, 400), 0.5), Targets(600, 30), 2.0)
    values = yaml.safe_load(helm_values(planned, options_for(profile.devices_per_instance, profile.device), "a plan"))
    # A GPU profile's plan goes over the chart's GPU values (CUDA image, UCX transports), whose HPAs it turns off.
    gpu = yaml.safe_load((CHART / "values-gpu.yaml").read_text())
    assert gpu["stages"]["prefill"]["autoscaling"]["enabled"]
    docs = _render(_layered(gpu, values))
    sets = kinds(docs, "StatefulSet")
    for stage in ("prefill", "decode"):
        spec = sets[f"mesh-infermesh-{stage}"]["spec"]
        assert spec["replicas"] == planned.replicas[stage]
        (main,) = spec["template"]["spec"]["containers"]
        assert str(main["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert "mesh-infermesh-vision" not in sets
    hpas = kinds(docs, "HorizontalPodAutoscaler")
    assert "mesh-infermesh-prefill" not in hpas and "mesh-infermesh-decode" not in hpas


def test_planned_vision_renders_over_a_vision_language_model():
    profile = dataclasses.replace(synthetic_profile(), device="cpu: 2 cores")
    planned = plan(profile, Workload(20, Lengths(1000), Lengths(100), 0.0, 1.0), Targets(800, 30), 2.0)
    values = yaml.safe_load(helm_values(planned, options_for(profile.devices_per_instance, profile.device)))
    assert values["stages"]["vision"]["gpus"] == 0  # measured on the CPU: no GPU asked for
    sets = kinds(_render({**values, "model": {"volume": {"emptyDir": {}}}}), "StatefulSet")
    assert sets["mesh-infermesh-vision"]["spec"]["replicas"] == planned.replicas["vision"] > 0
