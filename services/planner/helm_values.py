"""A Helm values file (YAML text) that deploys a plan with deploy/helm/infermesh: each
stage's replica count, its GPUs per pod, and the stage's HPA off (the plan sizes the
stage; an HPA would fight it). Only the keys the plan decides are written, so the
file layers over the operator's own values (`helm install -f theirs.yaml -f plan.yaml`);
a GPU profile's plan over deploy/helm/infermesh/values-gpu.yaml or the operator's copy
of it (the CUDA image and UCX transports a GPU stage needs are not the plan's to set).

A stage the plan gives no replicas is disabled (vision without images). The chart
refuses the vision stage on its demo model (a text model): the operator's values
name a vision-language model, as they would without the planner.
"""

from dataclasses import dataclass

import yaml

from services.planner.plan import Plan

STAGES = ("prefill", "decode", "vision")


@dataclass(frozen=True, slots=True)
class HelmOptions:
    gpus_per_pod: dict[str, int]
    """Per stage: the chart's `gpus` (0 runs on the CPU). From the profile's
    devices_per_instance where the profile was measured on GPUs."""


def options_for(devices_per_instance: dict[str, int], device: str) -> HelmOptions:
    """GPUs per pod from the profile: none where it was measured on the CPU."""
    on_cpu = device.lower().startswith("cpu")
    return HelmOptions({stage: 0 if on_cpu else devices_per_instance.get(stage, 1) for stage in STAGES})


def helm_values(plan: Plan, options: HelmOptions, header: str = "") -> str:
    stages = {}
    for stage in STAGES:
        replicas = plan.replicas.get(stage, 0)
        entry: dict[str, object] = {"enabled": replicas > 0}
        if replicas > 0:
            entry |= {"replicas": replicas, "gpus": options.gpus_per_pod.get(stage, 0),
                      "autoscaling": {"enabled": False}}
        stages[stage] = entry
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.safe_dump({"stages": stages}, sort_keys=False)
