"""A checkpoint's fingerprint: what the KV block chain mixes in, so blocks of
another model never match. Config alone is not enough (two seeds of the same
shape share it), and hashing gigabytes of weights at every start is too slow,
so we hash the config plus the size, head and tail of every weights file."""

import hashlib
from pathlib import Path

from shared.model.config import ModelConfig

_SAMPLE_BYTES = 1 << 20


def model_fingerprint(path: str | Path) -> str:
    folder = Path(path)
    h = hashlib.sha256(ModelConfig.from_pretrained(folder).fingerprint().encode())
    for weights in sorted(folder.glob("*.safetensors")):
        size = weights.stat().st_size
        h.update(weights.name.encode() + size.to_bytes(8, "little"))
        with weights.open("rb") as f:
            h.update(f.read(_SAMPLE_BYTES))
            f.seek(max(size - _SAMPLE_BYTES, 0))
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()
