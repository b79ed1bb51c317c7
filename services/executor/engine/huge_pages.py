"""The CPU engine's weights and KV cache in transparent huge pages.

A decode step streams every weight from memory, and decode attention reads KV blocks scattered
over gigabytes: on 4 KiB pages that is a TLB miss every 4 KiB and a page walk the hardware
prefetchers cannot run ahead of. Most Linux hosts ship transparent huge pages in `madvise` mode
(`/sys/kernel/mm/transparent_hugepage/enabled`), where memory gets 2 MiB pages only if it asks:
torch's allocator does not ask (unless THP_MEM_ALLOC_ENABLE=1 is set before it starts), and its
tensors of a few MiB would each straddle a huge page's boundaries anyway. So the engine packs its
weights, and allocates its CPU KV cache, into regions of its own: anonymous private mappings,
2 MiB-aligned, advised MADV_HUGEPAGE before their first touch. Where THP is `never`, or the
platform has no MADV_HUGEPAGE, tensors stay where torch put them.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
REGION = 64 << 20  # a region's size, unless one tensor needs more
ALIGN = 64  # each tensor starts on a cache line
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """always, madvise or never (the bracketed word of the sysfs file); never where unreadable."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "never"


def available() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


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

    def _new_region(self, nbytes: int) -> None:
        size = -(-max(nbytes, self.region_bytes) // HUGE_PAGE) * HUGE_PAGE
        mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults take 2 MiB pages
        whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while it lives
        start = -whole.data_ptr() % HUGE_PAGE
        self.region, self.used = whole[start:start + size], 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous tensor (its pages are zero until written)."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        with self.lock:
            if self.region is None or self.used + nbytes > self.region.numel():
                self._new_region(nbytes)
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
