"""The CPU decode-attention kernel (C++), built on first use with torch's extension loader.

It reads keys and values in place through the block table. When no compiler is available the
torch backend falls back to gathering blocks and calling SDPA.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "cpu" / "paged_decode_attention.cpp"
_lock = threading.Lock()
_module = None
_failed = False


def _cpu_signature() -> str:
    """Builds use -march=native, so a build is only reused on the same kind of processor."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:10]


def load():
    """The compiled module, or None if it cannot be built here."""
    global _module, _failed
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils.cpp_extension import load as load_extension

                _module = load_extension(
                    name=f"jetserve_cpu_attention_{_cpu_signature()}",
                    sources=[str(_SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-ffast-math"],
                    verbose=False,
                )
            except Exception as exc:  # no compiler, no headers: the torch path still works
                log.warning("CPU attention kernel unavailable, using the gather + SDPA path: %s", exc)
                _failed = True
        return _module


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           q_rows: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """Writes out[q_rows[s]] = softmax(q k^T * scale) v over sequence s's cached keys."""
    load().paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, q_rows, out, scale)
