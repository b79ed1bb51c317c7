"""The CPU engine's weights and KV cache in transparent huge pages (huge_pages.py): copies are
exact, regions are 2 MiB-aligned and get huge pages where the host's THP mode allows, a region
goes when its last tensor does, and the engine's tokens do not change (the KV cache's pages:
kv_cache.huge_pages, off by default)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

from services.executor.engine import huge_pages
from services.executor.engine.huge_pages import HUGE_PAGE, HugePageArena
from services.executor.engine.llm_engine import Engine
from shared.protocol import GenerateRequest
from tests.conftest import generate_all, tiny_config


def mapping_of(address: int) -> dict | None:
    """The /proc/self/smaps entry holding `address`: its start and end, AnonHugePages (bytes:
    huge pages the kernel gave, over the whole mapping, which adjacent regions may share) and
    whether it was advised MADV_HUGEPAGE (`hg` in VmFlags: exact, whatever the kernel gave)."""
    entry = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                entry = {"start": start, "end": end} if start <= address < end else None
            elif entry is not None and head == "AnonHugePages:":
                entry["huge"] = int(line.split()[1]) * 1024
            elif entry is not None and head == "VmFlags:":
                entry["advised"] = "hg" in line.split()[1:]
                return entry
    return None


needs_thp = pytest.mark.skipif(not huge_pages.available(),
                               reason=f"no huge pages to ask for here (THP mode "
                                      f"{huge_pages.thp_mode()})")


@needs_thp
def test_tensors_are_exact_copies_in_huge_pages_and_a_region_goes_with_its_last_tensor():
    arena = HugePageArena(region_bytes=8 << 20)
    sources = [torch.randn(513, 77), torch.arange(100, dtype=torch.int8),
               torch.randn(3, 5).t(),  # not contiguous: copied contiguous
               torch.randn(3 << 20),  # 12 MiB: more than a region, a region of its own
               torch.randn(7, dtype=torch.float64)]  # back in the first region
    copies = [arena.take(t) for t in sources]
    for source, copy in zip(sources, copies):
        assert torch.equal(source, copy) and copy.is_contiguous()
        assert copy.data_ptr() % 64 == 0
    assert copies[0].data_ptr() % HUGE_PAGE == 0  # a region starts on a huge page
    assert copies[1].data_ptr() - copies[0].data_ptr() == -(-513 * 77 * 4 // 64) * 64  # packed
    assert copies[3].data_ptr() % HUGE_PAGE == 0  # its own region
    assert copies[4].data_ptr() - copies[2].data_ptr() == 64  # after the 15 floats, aligned
    for copy in (copies[0], copies[3]):  # advised, and the kernel gave huge pages
        entry = mapping_of(copy.data_ptr())
        assert entry is not None and entry["advised"] and entry["huge"] >= HUGE_PAGE, entry
    assert arena.take(None) is None
    big = copies[3].data_ptr()
    del arena, copies[3], copy  # (the loops above left copy bound to it)
    gc.collect()
    assert mapping_of(big) is None  # unmapped with its one tensor
    assert torch.equal(copies[0], sources[0])  # the arena gone, its tensors stay


@needs_thp
def test_an_empty_tensor_is_shaped_and_typed():
    arena = HugePageArena(region_bytes=HUGE_PAGE)
    t = arena.empty((4, 8, 3), torch.bfloat16)
    assert t.shape == (4, 8, 3) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert arena.empty((0,), torch.float32).numel() == 0
    fresh = HugePageArena()
    assert fresh.empty((0, 4), torch.int8).shape == (0, 4) and fresh.region is None  # no region


@needs_thp
@pytest.mark.parametrize("settings", [
    {}, {"model.dtype": "bfloat16"}, {"model.quantization": "int8"},
    {"model.quantization": "int4"},
    {"model.quantization": "int4", "model.quantized_activations": "int8"},
    {"kv_cache.dtype": "int8"}, {"kv_cache.compress_below_priority": 5}])
async def test_the_engine_gives_the_same_tokens_with_and_without_huge_pages(settings):
    requests = [GenerateRequest(prompt_token_ids=list(range(5 + i, 40 + 7 * i)), max_tokens=12,
                                temperature=0.0, ignore_eos=True) for i in range(4)]
    tokens = {}
    # (weights, KV cache) in huge pages: both; the weights alone (the default); neither
    for on, kv_on in ((True, True), (True, False), (False, False)):
        engine = Engine(tiny_config({**settings, "model.huge_pages": on,
                                     "kv_cache.huge_pages": kv_on}))
        try:
            model = engine.runner.model
            kv = [t for pool in engine.runner.kv_pools for k, v in pool for t in (k, v)]
            for tensor in kv:
                entry = mapping_of(tensor.data_ptr())
                assert entry is not None and entry["advised"] == kv_on, (kv_on, entry)
            tensors = []
            for linear in [model.lm_head, *(m for layer in model.layers for m in (
                    layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))]:
                w = linear.weight
                tensors += [w] if isinstance(w, torch.Tensor) else [
                    t for t in (w.q, w.scale, w.min, w.sums) if t is not None]
            for tensor in tensors:  # packed weights (every field): advised or not
                entry = mapping_of(tensor.data_ptr())
                assert entry is not None and entry["advised"] == on, (on, entry)
            tokens[on, kv_on] = [o.token_ids for o in await generate_all(engine, requests)]
        finally:
            await engine.stop()
    assert tokens[True, True] == tokens[True, False] == tokens[False, False]


RESIDENT = """
import sys
from services.executor.engine.llm_engine import Engine
from shared.config import engine_config
engine = Engine(engine_config({"model.name": "dummy:smollm2-135m", "model.dtype": "float32",
                               "kv_cache.num_blocks": 16, "model.huge_pages": sys.argv[1] == "1"}))
status = dict(line.split(":") for line in open("/proc/self/status"))
print(status["VmHWM"].split()[0], status["VmRSS"].split()[0])
"""


@needs_thp
def test_moving_the_weights_into_huge_pages_leaves_no_copy_resident():
    """Each weight moves as soon as it is packed, so the next one's packing reuses what the move
    freed (540 MB of fp32 weights here; moved at the end, the peak held them twice), and what is
    freed goes back to the OS (before release_freed, glibc kept it: 420 MB more resident)."""
    def peak_and_resident_mb(on: bool) -> tuple[float, float]:
        out = subprocess.run([sys.executable, "-c", RESIDENT, "1" if on else "0"], check=True,
                             capture_output=True, text=True, timeout=300).stdout
        peak, resident = out.split()[-2:]
        return int(peak) / 1024, int(resident) / 1024

    (on_peak, on), (off_peak, off) = peak_and_resident_mb(True), peak_and_resident_mb(False)
    assert on <= off + 32 and on_peak <= off_peak + 64, (on, off, on_peak, off_peak)
