"""A vision instance's embedding cache: image identity -> the tower's output and the
image's grid, least recently used first out, in two tiers bounded in bytes: the
device (where the tower wrote them, ready to send without a copy back), then host
memory. On a CPU instance both tiers are host memory, still bounded apart, so the
bounds behave as they will on a GPU. No locks: only the service's event loop touches it."""

from collections import OrderedDict
from dataclasses import dataclass

import torch

from shared.model.vision.mrope import GridTHW


@dataclass(slots=True)
class Entry:
    embeds: torch.Tensor
    grid: GridTHW
    on_device: bool

    @property
    def num_bytes(self) -> int:
        return self.embeds.numel() * self.embeds.element_size()


class EmbeddingCache:
    def __init__(self, device_bytes: int, host_bytes: int) -> None:
        self.device_bytes = device_bytes
        self.host_bytes = host_bytes
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # least recently used first
        self.used_device = 0
        self.used_host = 0

    def get(self, key: bytes) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: bytes, embeds: torch.Tensor, grid: GridTHW) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._account(old, -1)
        entry = Entry(embeds, grid, on_device=True)  # fresh from the tower: its tier
        self._entries[key] = entry
        self._account(entry, 1)
        self._shrink()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def recent(self, limit: int) -> list[bytes]:
        """The identities held, the most recently used first, at most limit."""
        out = []
        for key in reversed(self._entries):
            if len(out) >= limit:
                break
            out.append(key)
        return out

    def _account(self, entry: Entry, sign: int) -> None:
        if entry.on_device:
            self.used_device += sign * entry.num_bytes
        else:
            self.used_host += sign * entry.num_bytes

    def _shrink(self) -> None:
        """Device tier over its bound: its least recently used move to host memory; host
        tier over its bound: its least recently used go (kvcache keeps them)."""
        for key, entry in list(self._entries.items()):
            if self.used_device <= self.device_bytes:
                break
            if entry.on_device:
                self._account(entry, -1)
                entry.embeds, entry.on_device = entry.embeds.to("cpu"), False
                self._account(entry, 1)
        for key, entry in list(self._entries.items()):
            if self.used_host <= self.host_bytes:
                break
            if not entry.on_device:
                self._account(entry, -1)
                del self._entries[key]
