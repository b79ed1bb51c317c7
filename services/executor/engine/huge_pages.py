"""The CPU engine's weights and KV cache in transparent huge pages.

A decode step streams every weight from memory, and decode attention reads KV blocks scattered
over gigabytes: on 4 KiB pages that is a TLB miss every 4 KiB and a page walk the hardware
prefetchers cannot run ahead of. Most Linux hosts ship transparent huge pages in `madvise` mode
(`/sys/kernel/mm/transparent_hugepage/enabled`), where memory gets 2 MiB pages only if it asks:
torch's allocator does not ask (unless THP_MEM_ALLOC_ENABLE=1 is set before it starts), and its
tensors of a few MiB would each straddle a huge page's boundaries anyway. So the engine moves
each weight, once packed (model.huge_pages), and allocates its CPU KV cache where
kv_cache.huge_pages asks, into regions of its own: anonymous private mappings aligned to a huge
page and advised MADV_HUGEPAGE before their first touch.
Where THP is `never`, or the platform has no MADV_HUGEPAGE, tensors stay where torch put them.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import threading
from pathlib import Path

import torch

THP = Path("/sys/kernel/mm/transparent_hugepage")
REGION = 64 << 20  # a region's size; a tensor as large or larger gets a region of its own
ALIGN = 64  # each tensor starts on a cache line


def huge_page_size() -> int:
    """The size of a transparent huge page: 2 MiB on x86-64 (and arm64 on 4 KiB pages)."""
    try:
        return int((THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE = huge_page_size()


def thp_mode() -> str:
    """always, madvise or never (the bracketed word of the sysfs file); never where unreadable."""
    try:
        text = (THP / "enabled").read_text()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "never"


@functools.cache
def available() -> bool:
    """Whether a mapping may ask for huge pages here: THP on, and the advice taken (a sandbox
    may refuse it)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or thp_mode() not in ("always", "madvise"):
        return False
    probe = mmap.mmap(-1, HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        probe.madvise(mmap.MADV_HUGEPAGE)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def arena_if(on: bool) -> HugePageArena | None:
    """An arena where `on` (model.huge_pages for the weights, kv_cache.huge_pages for the KV
    cache) and the host can give huge pages, else None."""
    return HugePageArena() if on and available() else None


def release_freed() -> None:
    """Hand what the process freed back to the OS (glibc's malloc_trim; nothing elsewhere). glibc
    keeps freed memory in its heap for later: after a load, the unpacked weights and the packed
    copies moved into huge pages, 420 MB of a fp32 SmolLM2's resident memory."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


class HugePageArena:
    """Tensors carved one after another from huge-page regions; a region is unmapped when no
    tensor of it is left. Nothing is freed on its own: for what lives as long as the engine."""

    def __init__(self, region_bytes: int = REGION):
        self.region_bytes = region_bytes
        self.region: torch.Tensor | None = None  # uint8, the current region
        self.used = 0
        self.lock = threading.Lock()

    @staticmethod
    def _map(nbytes: int) -> torch.Tensor:
        """A new region of at least `nbytes` (uint8), starting on a huge page."""
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults take huge pages
        except OSError:  # refused (a sandbox): 4 KiB pages, still one aligned region
            pass
        # The tensor holds the mapping, which is unmapped when the last view of it goes. Never
        # keep `mapping` itself or close() it: torch does not stop a close under live tensors.
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        start = -whole.data_ptr() % HUGE_PAGE
        return whole[start:start + size]

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous tensor (its pages are zero until written)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if nbytes >= self.region_bytes:  # its own region; the current one goes on filling
            return self._map(nbytes)[:nbytes].view(dtype).view(shape)
        with self.lock:
            if self.region is None or self.used + nbytes > self.region.numel():
                self.region, self.used = self._map(self.region_bytes), 0
            out = self.region[self.used:self.used + nbytes]
            self.used = -(-(self.used + nbytes) // ALIGN) * ALIGN
        return out.view(dtype).view(shape)

    def take(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A copy of CPU tensor `t` here (None stays None)."""
        if t is None or t.device.type != "cpu" or t.numel() == 0:
            return t
        out = self.empty(tuple(t.shape), t.dtype)
        out.copy_(t)
        return out
