# step NAME SECONDS COMMAND...: runs COMMAND under a time limit, logs its output and its exit
# status to $LOG (and the terminal). Sourced by gpu_check.sh and amx_check.sh, so that a step
# that fails or hangs leaves the others' figures.
step() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local start=$SECONDS
    PYTHONUNBUFFERED=1 timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
}
