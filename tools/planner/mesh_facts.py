"""What a profile records about the mesh it measured, apart from timings: the
device, the model and its settings (the balancer's model card and /ready, the
workers' vllm:cache_config_info and speculation series), and the KV bytes one
token of context takes. Read once before the sweep, so the timed part sends
nothing but requests."""

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tools.bench.raw_file import cpu

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""One scrape: (series name, labels) -> value."""
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1}


def scrape(url: str) -> Samples:
    """Every sample a /metrics endpoint serves."""
    return parse_samples(httpx.get(url, timeout=10).raise_for_status().text)


def parse_samples(text: str) -> Samples:
    """Every sample of a /metrics page's text."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def series_sum(samples: Samples, name: str) -> float:
    """The sum of every sample of `name`, whatever its labels (0 when absent)."""
    return sum(v for (n, _), v in samples.items() if n == name)


def device() -> str:
    """The GPUs nvidia-smi lists (the mesh's, when it runs on this machine), else the CPU."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20, check=True).stdout  # fmt: skip
            names = [line.strip() for line in out.splitlines() if line.strip()]
            if names:
                return f"{names[0]} (x{len(names)})"
        except (OSError, subprocess.SubprocessError):
            pass
    return f"cpu: {cpu()}"


@dataclass(slots=True)
class MeshFacts:
    model: str
    max_model_len: int | None
    instances: dict[str, int]
    """Live instances per stage, as the balancer's /ready counts them."""
    settings: dict[str, str] = field(default_factory=dict)
    block_size: int | None = None
    cache_dtype: str | None = None
    speculating: bool = False


def worker_stage(samples: Samples) -> str | None:
    """prefill, decode or vision: which stage's series a worker's scrape carries."""
    for stage in ("prefill", "decode", "vision"):
        if any(n.startswith(f"infermesh_{stage}_") for n, _ in samples):
            return stage
    return None


def read_facts(api: httpx.Client, worker_metrics: dict[str, Samples]) -> MeshFacts:
    """api: a client on the balancer's root (…:PORT, not …/v1)."""
    card = api.get("/v1/models").raise_for_status().json()["data"][0]
    ready = api.get("/ready").json()
    facts = MeshFacts(card["id"], card.get("max_model_len"), {k: int(v) for k, v in ready.get("instances", {}).items()})
    settings = {"max_model_len": str(facts.max_model_len), "instances": ",".join(f"{k}={v}" for k, v in
                sorted(facts.instances.items())), "kvcache": str(ready.get("kvcache"))}  # fmt: skip
    for url, samples in sorted(worker_metrics.items()):
        stage = worker_stage(samples) or url
        for (name, labels), _ in samples.items():
            if name == "vllm:cache_config_info":
                info = dict(labels)
                facts.block_size = int(info["block_size"])
                facts.cache_dtype = info.get("cache_dtype")
                for key in ("block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks"):
                    if key in info:
                        settings[f"{stage}.{key}"] = info[key]
        spec = any(n.startswith("vllm:spec_decode") for n, _ in samples)
        settings[f"{stage}.speculation"] = "on" if spec else "off"
        facts.speculating = facts.speculating or (stage == "decode" and spec)
    facts.settings = settings
    return facts


def kv_bytes_per_token(model_dir: str | Path | None, cache_dtype: str | None) -> int | None:
    """layers x KV heads x head dim x 2 (K and V) x dtype bytes, from the checkpoint's
    config; None without a local checkpoint (a remote mesh), for a dtype we do not know,
    or for a model whose KV is not full attention in every layer."""
    if model_dir is None or not (Path(model_dir) / "config.json").exists():
        return None
    from shared.model.config import ModelConfig

    config = ModelConfig.from_pretrained(model_dir)
    if config.deepseek_v4 is not None or any(w is not None for w in config.sliding_windows):
        return None  # compressed or windowed KV: not a per-token constant of this formula
    dtype_bytes = _DTYPE_BYTES.get(cache_dtype or "")
    if dtype_bytes is None:
        return None
    return config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2 * dtype_bytes
