#!/usr/bin/env bash
# Everything jetserve checks and measures on a CUDA GPU, in one run that fits in ten minutes:
# the Triton kernels against their references, their compile for the card, the kernel benchmark,
# and the engine benchmark (its triton attention backend against its torch one) on the SmolLM2-135M and Llama-3-8B
# shapes. Each step has its own time limit, so one that fails or hangs leaves the others'
# figures. Output: $OUT (default results/gpu) gets gpu_check.log and one JSON per benchmark.
#
#   bash loadtest/gpu_check.sh
#
# Without the default model's GGUF (a machine that cannot fetch it), the engine runs random
# weights of the real shapes (`dummy:<shape>`: the same work per token, not the same text),
# with the tokenizer files in $TOKENIZER (model.tokenizer). Where the GGUF is installed, set
# MODELS="SmolLM2-135M-Instruct dummy:llama-3-8b" to run the real SmolLM2 weights.
set -u
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
MODELS=${MODELS:-"dummy:smollm2-135m dummy:llama-3-8b"}
SWEEP=${SWEEP:-"8 64 256"}
LOG="$OUT/gpu_check.log"
tokenizer=()
[ -n "${TOKENIZER:-}" ] && tokenizer=(--tokenizer "$TOKENIZER")

# shellcheck source=loadtest/check_step.sh
. "$(dirname "${BASH_SOURCE[0]}")/check_step.sh" || exit 1  # step NAME SECONDS COMMAND...

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
torch.cuda.get_device_name(0))'
    nproc
} 2>&1 | tee -a "$LOG"

step kernel-tests 90 "$PY" -m pytest -q --noconftest -p no:cacheprovider tests/kernels/test_kernels.py
step compile-check 40 "$PY" -m jetserve_kernels.compile_check --arch 90
step kernel-bench 90 "$PY" -m jetserve_kernels.bench --result-json "$OUT/kernels_bench.json"
# One run per attention backend, each with its own limit and JSON (the torch backend is the
# baseline; `same tokens` between the two is read from the JSONs' token_ids).
for model in $MODELS; do
    name=${model#dummy:}
    limit=80
    [[ $model == *8b* ]] && limit=100
    for backend in triton torch; do
        # shellcheck disable=SC2086  # the sweep is a list of counts
        step "engine-bench $model $backend" "$limit" "$PY" -m loadtest.engine_bench \
            --model "$model" "${tokenizer[@]}" --attention-backend "$backend" --skip-hf \
            --sweep $SWEEP --result-json "$OUT/engine_${name}_${backend}.json"
    done
done
