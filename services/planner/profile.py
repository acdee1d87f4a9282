"""A stage profile: what one instance of each stage does at measured operating
points, the planner's only input about the hardware (Dynamo's pre-deployment
profile, with our own data). `infermesh profile` writes it (tools/planner/sweep.py),
`infermesh plan` and the live planner read it (services/planner/).

One JSON file, torch-free. Every point is one instance of its stage measured
alone, behind HTTP as a user gets it; latencies in milliseconds, rates per
second of wall time.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 1


@dataclass(slots=True, frozen=True)
class PrefillPoint:
    """Prefill at one uncached prompt length and number of prompts in flight."""

    input_tokens: int
    """Uncached prompt tokens per request."""
    concurrency: int
    """Requests in flight on the instance while measured."""
    ttft_ms: float
    """Median time to first token (queue + prefill; measured with max_tokens 1, so no
    handoff to decode: plan adds it from transfer.handoff_gb_s)."""
    tokens_per_s: float
    """Uncached prompt tokens computed per second by the instance."""


@dataclass(slots=True, frozen=True)
class DecodePoint:
    """Decode at one batch size and context length."""

    batch: int
    """Requests decoding at once on the instance."""
    context_tokens: int
    """Tokens of KV each of them attends to (prompt + generated), on average."""
    itl_ms: float
    """Median inter-token latency a request sees."""
    tokens_per_s: float
    """Output tokens per second of the instance (all its requests)."""


@dataclass(slots=True, frozen=True)
class VisionPoint:
    """The encoder at one number of images in flight and one image size
    (tools/planner/vision_round.py)."""

    concurrency: int
    """Images in flight on the instance (one per chat) while measured."""
    images_per_s: float
    """Images encoded per second the stage was busy (at least one encode asked for)."""
    latency_ms: float
    """From the balancer asking the instance to its reply that the embeddings are stored:
    the mean per round, the median over rounds (what an image adds to TTFT)."""
    image_px: int | None = None
    """The images' side in pixels (square). None in a profile written before the sweep had
    a size axis: its one size is settings["sweep.vision_image_px"] (Profile.from_json
    fills it in from there)."""


@dataclass(slots=True, frozen=True)
class KVCachePoint:
    """A prompt loaded from kvcache, no engine instance holding it (after a restart or an
    eviction), against the same prompt computed (tools/planner/kvcache_round.py)."""

    input_tokens: int
    ttft_hit_ms: float
    """Median TTFT with the prompt's full blocks loaded from kvcache (max_tokens 1)."""
    ttft_uncached_ms: float
    """Median TTFT of the same prompt computed whole, in the same rounds."""
    gb_s: float
    """Median over the rounds of the load's bytes over its seconds (prefill workers'
    kv_transfer_*_total{path="kvcache"})."""


@dataclass(slots=True, frozen=True)
class TransferRates:
    """Bytes moved per second, None where not measured."""

    kvcache_gb_s: float | None = None
    """kvcache load into an engine (hit path): the profile's kvcache round, a prompt no
    instance holds loaded back from kvcache; its bytes over the seconds from asking
    kvcache to the blocks' arrival in the engine, every timed round together."""
    handoff_gb_s: float | None = None
    """prefill -> decode KV handoff: the decode workers' KV bytes loaded over the seconds
    from asking for them to their arrival in the engine (kv_transfer_seconds_total)."""
    kv_bytes_per_token: int | None = None
    """KV bytes of one token of context (all layers), to turn tokens into bytes."""


@dataclass(slots=True)
class Profile:
    """Per stage, its measured points; and what they were measured on."""

    model: str
    device: str
    """The hardware, in words ("cpu: 2 cores AMD EPYC", "NVIDIA H200")."""
    commit: str
    command: str
    """The command that measured it (to rerun it)."""
    created_unix: float
    devices_per_instance: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1, "vision": 1})
    """GPUs (or CPU sockets) one instance of each stage takes: what a replica costs."""
    settings: dict[str, str] = field(default_factory=dict)
    """The engine and mesh settings in force (max_num_seqs, block size, speculation, ...)."""
    prefill: list[PrefillPoint] = field(default_factory=list)
    decode: list[DecodePoint] = field(default_factory=list)
    vision: list[VisionPoint] = field(default_factory=list)
    kvcache: list[KVCachePoint] = field(default_factory=list)
    """Cache hits against the same prompts uncached (empty: not measured)."""
    transfer: TransferRates = field(default_factory=TransferRates)
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        raw = json.loads(text)
        if raw.get("version") != FORMAT_VERSION:
            raise ValueError(f"profile format version {raw.get('version')!r}, this planner reads {FORMAT_VERSION}")
        return cls(
            model=raw["model"], device=raw["device"], commit=raw["commit"], command=raw["command"],
            created_unix=float(raw["created_unix"]),
            devices_per_instance={k: int(v) for k, v in raw["devices_per_instance"].items()},
            settings={k: str(v) for k, v in raw.get("settings", {}).items()},
            prefill=[PrefillPoint(**p) for p in raw.get("prefill", [])],
            decode=[DecodePoint(**p) for p in raw.get("decode", [])],
            vision=[_vision_point(p, raw.get("settings", {})) for p in raw.get("vision", [])],
            kvcache=[KVCachePoint(**p) for p in raw.get("kvcache", [])],
            transfer=TransferRates(**raw.get("transfer", {})),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        return cls.from_json(Path(path).read_text())


def _vision_point(raw: dict, settings: dict) -> VisionPoint:
    """A vision point as written; one from before the size axis gets the one size its
    sweep used (settings["sweep.vision_image_px"], a single int then), or stays None."""
    if raw.get("image_px") is None:
        size = str(settings.get("sweep.vision_image_px", ""))
        raw = {**raw, "image_px": int(size) if size.isdigit() else None}
    return VisionPoint(**raw)
