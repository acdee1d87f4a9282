"""A mesh request's images where an engine stage runs them (prefill, and decode, which
needs them for what it recomputes): the wire's lossless PNGs decoded and run through
the model's image processor off the event loop, named by the identities the balancer
sent, as the RequestImages an EngineRequest takes. The engine then runs the vision
tower on a worker thread of its own (AsyncEngine), also off the step loop, over the
images whose rows it computes (decode after a handoff: none whose KV it loads).

E/P/D: images a vision instance encoded (ImageData.embedded) are fetched from kvcache
by their identities instead (shared/stage/embeddings.py, a "transfer" span), and the
engine runs no tower for them. Where the vision instance says it also holds an image in
its arena (ImageData.peer_source), the embeddings are taken from there and only the
others asked of kvcache: copied straight out of its shared memory where this process
can map it (shared/stage/embedding_share.py: one host, one PID namespace or a shared
kv_share_dir), else READ through NIXL where the instance offers that
(shared/stage/embedding_nixl.py: another container, pod or node; the process's NIXL
agent, vision.nixl on the instance), as long as its ring has not come round to them.
The span's `transfer.path` (peer, nixl, kvcache, or those joined by +: peer+kvcache)
and the counter `image_embeddings_loaded_total{path}` say which way each image came. A
fetch that misses or fails (kvcache down, the blob evicted) falls back to the PNGs: the
request is never lost for it."""

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from opentelemetry.trace import Tracer

from shared.engine.engine_request import RequestImages
from shared.engine.sampling_params import InvalidParam
from shared.proto import mesh_pb2
from shared.runtime.metrics import Metrics
from shared.stage.convert import image_from_proto
from shared.stage.embedding_share import ArenaReader, EmbeddingSource

if TYPE_CHECKING:
    from shared.stage.embedding_nixl import NixlArenaReader
    from shared.kv.wire.client import KVCacheClient
    from shared.model.vision.processor import ImageProcessor

log = logging.getLogger(__name__)


class StageImages:
    def __init__(self, processor: "ImageProcessor | None", kvcache: "KVCacheClient | None" = None,
                 fetch_timeout_s: float = 5.0, metrics: Metrics | None = None,
                 nixl: "NixlArenaReader | None" = None) -> None:  # fmt: skip
        """processor: the model's image processor; None for a text-only model. kvcache:
        where embeddings a vision instance stored are fetched (None: never). nixl: reads
        vision instances' arenas through this process's NIXL agent (None: no agent)."""
        self.processor = processor
        self.kvcache = kvcache
        self.fetch_timeout_s = fetch_timeout_s
        self.peers = ArenaReader()
        self.nixl = nixl
        self.m_loaded = None
        if metrics is not None:
            self.m_loaded = metrics.counter("image_embeddings_loaded_total", "Images whose embeddings a vision "
                                            "instance made, by the way they came (peer: copied from its shared "
                                            "memory on this host; nixl: read from it through NIXL; kvcache)",
                                            ("path",))  # fmt: skip

    @classmethod
    async def load(cls, model_dir: str | Path, vision_language: bool, kvcache: "KVCacheClient | None" = None,
                   fetch_timeout_s: float = 5.0, metrics: Metrics | None = None,
                   nixl: "NixlArenaReader | None" = None) -> "StageImages":  # fmt: skip
        """The model's processor for a vision-language model (importing transformers takes
        seconds: on a worker thread), none for another."""
        if not vision_language:
            return cls(None)
        from shared.model.vision.processor import ImageProcessor

        return cls(await asyncio.to_thread(ImageProcessor, model_dir), kvcache, fetch_timeout_s, metrics, nixl)

    def _read_peers(self, messages: Sequence[mesh_pb2.ImageData]) -> tuple[dict[bytes, tuple[str, bytes]],
                                                                          dict[bytes, str], list[str]]:  # fmt: skip
        """The blobs taken out of vision instances' arenas, by identity, the way each came
        ("peer" or "nixl"), and why the others with a peer_source could not be (on a
        worker thread)."""
        held, ways, refused = {}, {}, []
        for msg in messages:
            key = bytes(msg.hash)
            if not msg.peer_source or key in held:
                continue
            try:
                source = EmbeddingSource.from_bytes(msg.peer_source)
            except ValueError as exc:
                refused.append(str(exc))
                continue
            try:
                held[key], ways[key] = self.peers.read(key, source), "peer"
                continue
            except ValueError as exc:  # another namespace or host, the instance gone, the entry overwritten
                reason = str(exc)
            if source.nixl and self.nixl is not None:
                try:
                    held[key], ways[key] = self.nixl.read(key, source), "nixl"
                    continue
                except ValueError as exc:  # no metadata, a failed transfer, the entry overwritten
                    reason = f"NIXL: {exc}"
            refused.append(reason)
        return held, ways, refused

    async def _fetched(self, messages: Sequence[mesh_pb2.ImageData], tracer: Tracer) -> RequestImages | None:
        """The images' embeddings, from the vision instance's memory where it can be
        mapped or read through NIXL, else from kvcache, under a "transfer" span; None when any is not there or
        kvcache fails (the caller encodes them from their PNGs)."""
        from shared.stage.embeddings import fetch_embeddings

        assert self.kvcache is not None
        hashes = tuple(msg.hash for msg in messages)
        with tracer.start_as_current_span("transfer") as span:
            span.set_attribute("transfer.what", "image_embeddings")
            span.set_attribute("images.count", len(messages))
            held, ways, refused = await asyncio.to_thread(self._read_peers, messages)
            if refused:
                log.info("%d image(s) not copied from the vision instance (%s): through kvcache", len(refused),
                         refused[0])  # fmt: skip
                span.set_attribute("transfer.peer_refused", refused[0])
            counts = {way: sum(1 for h in hashes if ways.get(bytes(h)) == way) for way in ("peer", "nixl")}
            counts["kvcache"] = len(hashes) - counts["peer"] - counts["nixl"]
            span.set_attribute("transfer.path", "+".join(way for way, n in counts.items() if n))
            span.set_attribute("images.peer", counts["peer"])
            span.set_attribute("images.nixl", counts["nixl"])
            try:
                embeddings = await fetch_embeddings(self.kvcache, hashes, self.fetch_timeout_s, held)
            except Exception as exc:  # kvcache down or slow, a bad blob: encode here instead
                log.warning("fetching image embeddings failed (%s): encoding them here", exc)
                span.set_attribute("transfer.outcome", "failed")
                return None
            span.set_attribute("transfer.outcome", "hit" if embeddings is not None else "miss")
            if embeddings is None:
                return None
            span.set_attribute("transfer.bytes", sum(e.numel() * e.element_size() for e in embeddings.embeds))
            if self.m_loaded is not None:
                for way, n in counts.items():
                    self.m_loaded.labels(way).inc(n)
            return RequestImages(embeddings, hashes)

    async def request_images(self, messages: Sequence[mesh_pb2.ImageData], tracer: Tracer) -> RequestImages | None:
        """The request's images for its EngineRequest (None without any), under an
        "images" span. InvalidParam("images") where this model takes none or a message
        is not the image it says (the balancer's bug: never encoded as another image)."""
        if not messages:
            return None
        processor = self.processor
        if processor is None:
            raise InvalidParam("images", "are not accepted by this model (a text-only model)")
        if self.kvcache is not None and all(msg.embedded for msg in messages):
            fetched = await self._fetched(messages, tracer)
            if fetched is not None:
                return fetched

        def process() -> RequestImages:
            pixels = [image_from_proto(msg, f"images.{k}") for k, msg in enumerate(messages)]
            return RequestImages(processor(pixels), tuple(msg.hash for msg in messages))

        with tracer.start_as_current_span("images") as span:
            span.set_attribute("images.count", len(messages))
            span.set_attribute("images.png_bytes", sum(len(msg.png) for msg in messages))
            try:
                return await asyncio.to_thread(process)
            except ValueError as exc:
                raise InvalidParam("images", f"could not be read: {exc}") from None
