"""The Helm chart rendered without a cluster: as `helm install` renders it, and as
`helm upgrade` renders it against a release whose Secrets already hold data (the
chart's `lookup`s answered from them), with the rendered Secrets as the API server
would hold them."""

import base64
import json
import re
from pathlib import Path

import helm_python as helm
import yaml

from tests.helpers.deploy_harness import kinds
from tests.helpers.mesh_procs import ROOT

CHART = ROOT / "deploy" / "helm" / "infermesh"
"""The chart's folder."""

LOOKUP_SECRET = re.compile(r'\(lookup "v1" "Secret" \.Release\.Namespace (\$\w+)\)')


def chart_with_live_secrets(live: dict[str, dict[str, str]], folder: Path) -> Path:
    """A copy of the chart whose `lookup`s of Secrets answer from `live` ({name: the
    Secret's data, base64 values, as the API server returns it}) instead of a cluster:
    what `helm upgrade` renders against a release whose Secrets are those. Every lookup
    in the chart must be of this one form, so none is left answering nothing."""
    import shutil

    copy = folder / "infermesh"
    shutil.copytree(CHART, copy)
    (copy / "live-secrets.json").write_text(json.dumps(live))
    found = 0
    for template in (copy / "templates").glob("*.yaml"):
        text = template.read_text()
        found += text.count('lookup "')
        text, n = LOOKUP_SECRET.subn(r'(dict "data" (get ($.Files.Get "live-secrets.json" | fromJson) \1 | default dict))',
                                     text)
        found -= n
        template.write_text(text)
    assert found == 0, "a lookup of another form: teach chart_with_live_secrets it"
    return copy


def render_chart(values: dict | None = None, name: str = "mesh",
                 live: dict[str, dict[str, str]] | None = None) -> list[dict]:
    """The chart as `helm install` renders it; with `live`, as `helm upgrade` renders it
    against a release whose Secrets hold that data (chart_with_live_secrets)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = CHART if live is None else chart_with_live_secrets(live, Path(tmp))
        with helm.Chart.load(path) as chart:
            rendered = chart.render(values, name=name, namespace="infermesh", is_install=live is None,
                                    is_upgrade=live is not None)
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def live_secrets(docs: list[dict]) -> dict[str, dict[str, str]]:
    """The rendered Secrets as the API server would hold them once applied (data, base64)."""
    out = {}
    for name, secret in kinds(docs, "Secret").items():
        data = dict(secret.get("data", {}))
        data |= {k: base64.b64encode(v.encode()).decode() for k, v in secret.get("stringData", {}).items()}
        out[name] = data
    return out
