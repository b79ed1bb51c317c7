"""The CPU kernels (C++ in jetserve_kernels/cpu/): decode and prefill attention over the paged
cache, matmuls over fp32, int8 and int4 weights, and the fused element-wise ops. Built on first use
with torch's extension loader, once per version of their source, into a build directory given to
`load` (by default `$XDG_CACHE_HOME/jetserve/cpu-kernels`, beside the converted models: one cache
volume).

The build directory is keyed by the sources, the compiler flags, torch and the processor, not by
the checkout, so every checkout of one version shares one build. A file lock (released by the
kernel when its holder dies) serializes builds, so a killed build leaves nothing to wait on.
Without a compiler the torch backend runs its plain torch path and says so once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import re
import shutil
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE_DIR = Path(__file__).parent / "cpu"
# -fopenmp: at::parallel_for is inline OpenMP; without it every kernel runs on one thread. The
# library it links (soname libgomp.so.1) resolves to the one torch has loaded already.
# JETSERVE_CPU_ARCH builds for another instruction set than this processor's (a GCC -march
# name, e.g. cascadelake: AVX-512 without AVX512-BF16; x86-64-v3: AVX2): the kernels' paths
# for CPUs this one stands in for. It must be a subset of what this processor can run (else the
# first kernel dies of an illegal instruction); tests/cpu_paths.sh checks that before it builds.
ARCH = os.environ.get("JETSERVE_CPU_ARCH", "native")
FLAGS = ["-O3", f"-march={ARCH}", "-ffast-math", "-fopenmp"]
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
    return "\n".join(lines)


def _check_arch() -> None:
    # The flags reach a shell command line (torch's ninja build): a name, nothing else.
    if not re.fullmatch(r"[A-Za-z0-9._+-]+", ARCH):
        raise ValueError(f"JETSERVE_CPU_ARCH={ARCH!r} is not a -march name (letters, digits, "
                         f"'.', '_', '+', '-')")


def build_key(sources: list[Path]) -> str:
    digest = hashlib.sha256()
    for part in (torch.__version__, platform.python_version(), " ".join(FLAGS), _cpu_signature()):
        digest.update(part.encode() + b"\0")
    for path in sorted(sources):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def default_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jetserve" / "cpu-kernels"


def build(name: str, files: list[Path], root: Path):
    """Import the extension `name` built from `files` (its .cpp sources and the headers they
    include) under root/<key>, building it first if no build of exactly these files exists.
    Raises when it cannot be built."""
    _check_arch()
    key = build_key(files)
    sources = [str(f) for f in files if f.suffix == ".cpp"]
    directory = root / key
    library = directory / f"{name}_{key}.so"
    if not library.exists():
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH; install g++ or "
                               f"set CXX)")
        import fcntl

        directory.mkdir(parents=True, exist_ok=True)
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes or the holder dies
            if not library.exists():  # else another process built it while this one waited
                # torch's own lock file: a build killed mid-way leaves it, and torch would then
                # wait for it forever. Holding the flock, nobody else is building here.
                (directory / "lock").unlink(missing_ok=True)
                log.warning("building the CPU kernels for this version into %s (once; about a "
                            "minute on two cores)", directory)
                start = time.monotonic()
                from torch.utils.cpp_extension import load as load_extension

                load_extension(name=f"{name}_{key}", sources=sources,
                               extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
                log.warning("CPU kernels built in %.0f s", time.monotonic() - start)
    spec = importlib.util.spec_from_file_location(f"{name}_{key}", library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(root: Path | None = None):
    """The compiled module, built under `root` (default_root() when None) if no build of these
    sources is there, or None if it cannot be built here (said once, with the reason). The
    first call's root is the one used."""
    global _module, _failed
    with _lock:
        if _module is None and not _failed:
            try:
                _module = build("jetserve_cpu", sorted(SOURCE_DIR.glob("*.[ch]*")),
                                root or default_root())
            except Exception as exc:  # no compiler, no headers: the torch path still works
                log.warning("CPU kernels unavailable, using the slower torch path: %s", exc)
                _failed = True
        return _module


def native_bf16() -> bool:
    """Whether the kernels multiply bf16 natively here (AVX512-BF16 dot products: Zen 4,
    Sapphire Rapids and later), which makes bf16 the CPU's default model dtype."""
    kernels = load()
    return kernels is not None and kernels.bf16_dot_products()
