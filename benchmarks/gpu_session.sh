#!/usr/bin/env bash
# The one command for a short GPU session (an H100 for ~15 minutes of device time; docs/hopper.md,
# "On the first H100 session"). Run from anywhere:
#
#     bash benchmarks/gpu_session.sh
#
# Everything goes under ${OUT:-./gpu_session_out}: one log per step (NN_name.log), hopper_variants.json,
# junit.xml, and summary.txt (start, end, rc and budget of every step; "skipped" once the total budget is
# spent). Steps run in priority order, each under `timeout` with its own budget capped by what is left of
# the total, and the script goes on past a failed step; it exits 0 when every step ran and passed, else 1.
#
# Environment: PYTHON (default: python, else python3), GPU_SESSION_BUDGET_S (total seconds, default 540),
# GPU_SESSION_<STEP>_S per-step budgets (STEP: SMI, INSTALL, PYTEST, VARIANTS, BACKWARD, DECODE, PRECISION,
# OVERHEAD; defaults below).
set -u

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT_DIR=${OUT:-./gpu_session_out}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
SUMMARY="$OUT_DIR/summary.txt"
TOTAL=${GPU_SESSION_BUDGET_S:-540}
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif command -v python >/dev/null 2>&1; then
    PY=python
else
    PY=python3
fi
START=$(date +%s)
FAILED=0
STEP=0
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

log() {
    printf '%s\n' "$*" | tee -a "$SUMMARY"
}

remaining() {
    echo $((TOTAL - ($(date +%s) - START)))
}

# run_step NAME BUDGET_S COMMAND...: under `timeout` (the smaller of its budget and what is left), output to
# NN_NAME.log, one line in summary.txt.
run_step() {
    local name=$1 budget=$2 left limit rc t0 t1 logfile
    shift 2
    STEP=$((STEP + 1))
    logfile=$(printf '%s/%02d_%s.log' "$OUT_DIR" "$STEP" "$name")
    left=$(remaining)
    limit=$budget
    if [ "$left" -lt "$limit" ]; then
        limit=$left
    fi
    if [ "$limit" -lt 5 ]; then
        log "step $STEP $name: skipped (total budget spent: ${left}s left of ${TOTAL}s)"
        FAILED=1
        return 0
    fi
    t0=$(date +%s)
    log "step $STEP $name: start $(date -u +%H:%M:%S) budget ${limit}s: $*"
    timeout -k 10 "$limit" "$@" >"$logfile" 2>&1
    rc=$?
    t1=$(date +%s)
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        log "step $STEP $name: end $(date -u +%H:%M:%S) rc $rc (TIMED OUT after $((t1 - t0))s) log $logfile"
    else
        log "step $STEP $name: end $(date -u +%H:%M:%S) rc $rc ($((t1 - t0))s) log $logfile"
    fi
    if [ "$rc" -ne 0 ]; then
        FAILED=1
    fi
    return 0
}

versions() {
    nvidia-smi
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.max.sm --format=csv
    "$PY" --version
    "$PY" - <<'EOF'
import platform
print("python", platform.python_version())
for name in ("numpy", "cupy", "torch", "flash_attn", "ml_dtypes"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(name, "unavailable:", type(e).__name__, e)
try:
    import cupy
    print("CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion())
    print("device", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "sm_" + cupy.cuda.Device().compute_capability)
except Exception as e:
    print("cupy device:", type(e).__name__, e)
try:
    from flasharray._private import nvrtc
    print("nvrtc", nvrtc.available())
except Exception as e:
    print("nvrtc:", type(e).__name__, e)
EOF
}

install() {
    # CuPy for CUDA 12 (setup.cfg's extra "cuda12") and pytest, NVRTC, the CUDA headers ("test").
    if "$PY" -c "import cupy, pytest" >/dev/null 2>&1; then
        echo "cupy and pytest importable: nothing to install"
        return 0
    fi
    "$PY" -m pip install --retries 1 --timeout 20 ".[cuda12,test]"
}

: >"$SUMMARY"
log "gpu_session: $(date -u '+%Y-%m-%d %H:%M:%S') UTC, total budget ${TOTAL}s, python $PY, out $OUT_DIR, git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

VARIANTS_S=${GPU_SESSION_VARIANTS_S:-180}
export PY
export -f versions install   # run by `timeout` through bash -c
# (0) CuPy / pytest when missing (a machine without the registry: the step fails, the rest still runs)
run_step install "${GPU_SESSION_INSTALL_S:-120}" bash -c install
# (1) what machine, which versions
run_step smi "${GPU_SESSION_SMI_S:-30}" bash -c versions
# (2) correctness on the GPU: every gpu test but the slow matrices (stops after 5 failures)
run_step pytest "${GPU_SESSION_PYTEST_S:-150}" "$PY" -m pytest -q -p no:cacheprovider -m "gpu and not slow" \
    --maxfail=5 -rfE --junitxml="$OUT_DIR/junit.xml" tests/
# (3) the Hopper switches on vs off (stops starting shapes 30 s before its budget, so its tables print)
left=$(remaining)
if [ "$left" -lt "$VARIANTS_S" ]; then
    VARIANTS_S=$left
fi
run_step hopper_variants "$VARIANTS_S" "$PY" benchmarks/hopper_variants.py \
    --max-seconds "$((VARIANTS_S > 60 ? VARIANTS_S - 30 : VARIANTS_S / 2))" --json "$OUT_DIR/hopper_variants.json"
# (4) forward and backward tables against PyTorch / FlashAttention-2 (N up to 2048)
run_step gpu_backward "${GPU_SESSION_BACKWARD_S:-90}" "$PY" benchmarks/gpu.py --quick --backward
# (5) decoding / GQA shapes against FlashAttention-2
run_step gpu_decode "${GPU_SESSION_DECODE_S:-30}" "$PY" benchmarks/gpu.py --decode
# (6) float32 precisions and float64 (N up to 4096)
run_step gpu_precision "${GPU_SESSION_PRECISION_S:-45}" "$PY" benchmarks/gpu.py --precision --quick
# (7) host overhead per call on the GPU
run_step overhead "${GPU_SESSION_OVERHEAD_S:-30}" "$PY" benchmarks/overhead.py --device cuda

log "gpu_session: done after $(($(date +%s) - START))s of ${TOTAL}s, $([ "$FAILED" -eq 0 ] && echo 'every step passed' || echo 'some step failed, timed out or was skipped')"
exit "$FAILED"
