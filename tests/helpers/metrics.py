"""Reading Prometheus /metrics in tests: a whole scrape as samples (with the
parser of prometheus_client), the balancer's counters of a running mesh, and one
unlabelled series of an exposition text (kvcache's gauges)."""

import re
import urllib.request
from typing import Any

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""A Prometheus scrape: (series name, labels) -> value."""


def scrape(url: str) -> Samples:
    """Every sample a /metrics endpoint serves."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10).raise_for_status().text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def balancer_metric(mesh: Any, name: str, **labels: str) -> float:
    """The sum of the balancer's series infermesh_balancer_<name> whose labels include
    `labels` (0 when it has no such series yet). mesh: a running tools.launch.up.Mesh."""
    with urllib.request.urlopen(mesh.api_url.removesuffix("/v1") + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    want = "".join(f'(?=[^}}]*{k}="{re.escape(v)}")' for k, v in labels.items())
    return sum(float(m.group(1)) for m in re.finditer(
        rf"^infermesh_balancer_{name}(?:\{{{want}[^}}]*\}})? ([0-9.e+]+)$", text, re.M))


def exposition_value(text: str, name: str) -> float:
    """The value of the unlabelled series `name` in an exposition text; an AssertionError
    when it has none."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")
