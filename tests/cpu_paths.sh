#!/usr/bin/env bash
# The CPU kernels' paths for processors other than this one: the kernels build with
# -march=native, so `make test` runs only the paths this CPU takes. This builds them again for
# older instruction sets (JETSERVE_CPU_ARCH, jetserve_kernels/cpu_ops.py) and runs the kernel
# tests on each build, and the engine's tests on the two that change what a model runs:
#   cascadelake     AVX-512 and AVX512-VNNI, no AVX512-BF16 (Cascade Lake, Ice Lake, Zen 3 has
#                   none of it): an fp32 model by default, bf16 weights widened to fp32
#   skylake-avx512  AVX-512 without VNNI: int8 activations on AVX2's 16-bit multiplies
#   x86-64-v3       AVX2 and FMA, no AVX-512 (Zen 2 and 3, Haswell to Alder Lake): AVX2
#                   tiles of their own for matmuls (int8 activations too) and for decode and
#                   prefill attention
# A build runs here only if this CPU has what it needs (a build for a CPU it is not would die
# of an illegal instruction). Unless named, a build whose path is this CPU's own is skipped too:
# the native build takes the same code paths (the kernels' #ifs name instruction sets, not
# CPUs), and make test has run them; only the native build's loading is checked for it. Each
# build takes a minute or so once (cached like the native one, under its own key); the tests run
# on two workers (TEST_JOBS=N for another count); the whole script about 4 minutes on 2 cores
# with the builds cached, 8 with the builds.
#
#   bash tests/cpu_paths.sh [ARCH ...]        # default: all three
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PATH="$PWD/.venv/bin:$PATH"  # the venv's ninja for torch's extension builds, as make's
archs=("$@")
named=${#archs[@]}
[ "$named" -gt 0 ] || archs=(cascadelake skylake-avx512 x86-64-v3)

# What each build needs of this CPU (/proc/cpuinfo's names).
needs() {
    case "$1" in
        cascadelake) echo "avx2 fma bmi2 avx512f avx512cd avx512bw avx512dq avx512vl avx512_vnni" ;;
        skylake-avx512) echo "avx2 fma bmi2 avx512f avx512cd avx512bw avx512dq avx512vl" ;;
        x86-64-v3) echo "avx2 fma bmi1 bmi2 f16c movbe" ;;
        *) echo "unknown" ;;  # not one this script knows: name it in needs() first
    esac
}

# Whether this CPU's own (native) build takes the path of the named one: the kernels choose by
# AVX2 and FMA, AVX-512 (F, BW), AVX512-VNNI and AVX512-BF16 (jetserve_kernels/cpu's #ifs),
# and the AVX-512 CPUs these builds stand for all have AVX2, FMA and BW.
own_path() {
    case "$1" in
        cascadelake) has avx512_vnni && ! has avx512_bf16 ;;
        skylake-avx512) has avx512f && ! has avx512_vnni ;;
        x86-64-v3) ! has avx512f ;;
        *) return 1 ;;
    esac
}
has() { [[ "$flags" == *" $1 "* ]]; }

# Whether the kernels build and load for JETSERVE_CPU_ARCH as the caller sets it (unset:
# -march=native). Checked before any tests: where they fail to, the tests skip the kernels (and
# the engine falls back to torch) and pass.
kernels_load() {
    "$PY" -c 'import sys; from jetserve_kernels import cpu_ops; sys.exit(cpu_ops.load() is None)'
}

flags=" $( (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true) | cut -d: -f2) "
if [ -z "${flags// /}" ]; then
    echo "== skipped: /proc/cpuinfo names no x86 flags here (the builds are x86 ones)"
    exit 0
fi
status=0
for arch in "${archs[@]}"; do
    missing=""
    for flag in $(needs "$arch"); do
        has "$flag" || missing="$missing $flag"
    done
    if [ -n "$missing" ]; then
        echo "== $arch: skipped, this CPU lacks:$missing"
        continue
    fi
    if [ "$named" -eq 0 ] && own_path "$arch"; then
        if kernels_load; then  # cached by make test: seconds
            echo "== $arch: this CPU's own build takes its path: it loads, and make test ran its tests"
        else
            echo "== $arch: FAILED: this CPU's own build, which takes its path, did not build"
            status=1
        fi
        continue
    fi
    # The engine's tests on the builds that change what a model runs (the default dtype, the
    # prefill kernel; on skylake-avx512, int8 activations); the kernel tests on every build.
    tests=(tests/kernels/test_cpu_ops.py)
    if [ "$arch" = skylake-avx512 ]; then
        tests+=(tests/executor/test_quantized.py)  # int8 activations on the AVX2 kernel
    else
        tests+=(tests/executor)
    fi
    echo "== $arch: ${tests[*]}"
    if ! JETSERVE_CPU_ARCH="$arch" kernels_load; then
        echo "== $arch: FAILED: the kernels did not build (the warning above says why)"
        status=1
        continue
    fi
    # Two workers, whole files each (as make test's): the build is cached by then.
    if ! JETSERVE_CPU_ARCH="$arch" "$PY" -m pytest -q -p no:cacheprovider -n "${TEST_JOBS:-2}" \
            --dist loadfile "${tests[@]}"; then
        echo "== $arch: FAILED"
        status=1
    fi
done
exit $status
