#!/usr/bin/env bash
# llama.cpp's Python bindings in their own virtualenv, .peers/llamacpp, as the "local chat app"
# peer for loadtest.peer_bench; never a jetserve dependency. Safe to run again: a build of the same
# version with the same flags is kept.
#
#     bash loadtest/peers/setup_llama_cpp.sh
#
# PyPI ships only the source, so pip builds llama.cpp here (about 10 minutes on 2 cores; run it
# under `nice` beside other work). It is compiled for this CPU's own instruction set, as a local
# install would be, so the venv is not portable to older CPUs. That is GGML_NATIVE's set less AMX:
# ggml's AMX matmul dies with SIGILL (`tilezero` on an invalid tile config) on this machine's
# Sapphire Rapids vCPUs, so the x86 features are switched on one by one from /proc/cpuinfo and
# AMX is left off (the AVX-512 VNNI kernels and weight repacking still apply).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="$root/.peers/llamacpp"
llama_cpp_version="0.3.36"

if [[ ! -x "$venv/bin/python" ]]; then
    echo "creating $venv"
    python3 -m venv "$venv"
fi
py="$venv/bin/python"

cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
cmake_args="-DGGML_NATIVE=OFF -DGGML_OPENMP=ON -DCMAKE_BUILD_TYPE=Release"
cmake_args+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
            avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    state=OFF
    [[ "$cpu_flags" == *" ${pair%%:*} "* ]] && state=ON
    cmake_args+=" -DGGML_${pair#*:}=$state"
done

# Rebuilt when the version or the build flags changed (a copy of the venv on another CPU).
stamp="$venv/llama-cpp-build.txt"
wanted="llama-cpp-python==$llama_cpp_version $cmake_args"
if ! "$py" -m pip show llama-cpp-python >/dev/null 2>&1 \
        || [[ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]]; then
    echo "building llama-cpp-python $llama_cpp_version from source: $cmake_args"
    CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$py" -m pip install --quiet --no-cache-dir --force-reinstall \
        "llama-cpp-python==$llama_cpp_version"
    echo "$wanted" >"$stamp"
fi

"$py" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
