#!/usr/bin/env bash
# The one command for a short GPU session (an H100 for ~15 minutes of device time; docs/hopper.md,
# "GPU sessions"). Run from anywhere:
#
#     bash benchmarks/gpu_session.sh
#
# Everything goes under ${OUT:-./gpu_session_out}: one log per step (NN_name.log), hopper_variants.json,
# junit.xml, and summary.txt (start, end, rc and budget of every step; "skipped" once the total budget is
# spent). Steps run in priority order, each under `timeout` with its own budget capped by what is left of
# the total, and the script goes on past a failed step; it exits 0 when every step ran and passed, else 1.
#
# Environment: PYTHON (default: python, else python3), GPU_SESSION_BUDGET_S (total seconds, default 540),
# GPU_SESSION_<STEP>_S per-step budgets (STEP: INSTALL, SMI, SMOKE, OVERHEAD, PYTEST, BACKWARD, MMA, MMA256, DECODE, PYTEST_SM90,
# PRECISION, FP64 (steps 7b, 7c and 7h each), FP32 (steps 7d-7g each), EXT, VARIANTS; defaults below), GPU_SESSION_PYTEST_WORKERS (pytest-xdist, default 12),
# GPU_SESSION_GO_ON=1 (go on after a failed smoke step), GPU_SESSION_STEPS (comma-separated step names: run only
# those, in the script's order, e.g. "smi,smoke,pytest_sm90"; the others are logged "not selected" and do not count
# as failed; a name that is no step exits 2 before anything runs; default: every step). A session with ~15 minutes of device time runs two calls, call A then call B
# (docs/hopper.md, "GPU sessions": budgets 420 and 330 s, so that both fit the 900 s with the machine's start):
#     GPU_SESSION_BUDGET_S=420 GPU_SESSION_STEPS=$CALL_A bash benchmarks/gpu_session.sh
#     GPU_SESSION_BUDGET_S=330 GPU_SESSION_STEPS=$CALL_B bash benchmarks/gpu_session.sh
# with the lists printed by `bash benchmarks/gpu_session.sh --calls`.
set -u

# The two calls of a ~15-minute session, in priority order (each fits one 600-s command). Call A: correctness on
# the GPU, then the float32 / float64 verdicts (issue 12: sessions 26-29 left them untimed). Call B: the fp16
# tables and switches (issues 9, 13).
CALL_A=install,smi,smoke,pytest,pytest_sm90,gpu_precision,gpu_fp64,gpu_fp64_k4,gpu_fp32_fwd_mma,gpu_fp32_bwd_mma,\
gpu_3xtf32_planes,gpu_fp32_one_block
CALL_B=install,smi,smoke,mma_verdicts,gpu_backward,mma_d256,gpu_decode,overhead,gpu_fp64_br16,hopper_ext,hopper_variants
if [ "${1:-}" = --calls ]; then
    printf 'CALL_A=%s\nCALL_B=%s\n' "$CALL_A" "$CALL_B"
    exit 0
fi
# GPU_SESSION_STEPS: every name a step of this script (a misspelt one would silently run nothing)
steps=${GPU_SESSION_STEPS:-}
for name in ${steps//,/ }; do
    if [[ ",$CALL_A,$CALL_B," != *",$name,"* ]]; then
        echo "gpu_session: GPU_SESSION_STEPS names no step '$name'; the steps: $CALL_A,$CALL_B" >&2
        exit 2
    fi
done

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
LAST_RC=0
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
    if [ -n "${GPU_SESSION_STEPS:-}" ] && [[ ",$GPU_SESSION_STEPS," != *",$name,"* ]]; then
        log "step $STEP $name: not selected (GPU_SESSION_STEPS)"
        LAST_RC=0
        return 0
    fi
    left=$(remaining)
    limit=$budget
    if [ "$left" -lt "$limit" ]; then
        limit=$left
    fi
    if [ "$limit" -lt 5 ]; then
        log "step $STEP $name: skipped (total budget spent: ${left}s left of ${TOTAL}s)"
        FAILED=1
        LAST_RC=skipped
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
    LAST_RC=$rc
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

smoke() {
    # One small forward + backward through the public API on the GPU, against the float64 reference:
    # when this fails nothing after it can mean anything, so the session stops there (a short call).
    "$PY" - <<'EOF'
import sys, time
import numpy as np
import cupy as cp
import flasharray as fa
from flasharray.testing import check_attention
t0 = time.time()
rng = np.random.default_rng(0)
q, k, v, do = (cp.asarray(rng.standard_normal((1, 2, 256, 64)).astype(np.float16)) for _ in range(4))
ok = True
for causal in (False, True):
    out, lse = fa.flash_attention_forward(q, k, v, causal=causal)
    grads = fa.flash_attention_backward(do, q, k, v, out, lse, causal=causal)
    report = check_attention(out, q, k, v, causal=causal, dout=do, grads=grads)
    print("causal=%s: %s" % (causal, "passed" if report.passed else "FAILED\n%s" % report))
    ok &= report.passed
print("smoke: %s in %.1f s" % ("passed" if ok else "FAILED", time.time() - t0))
sys.exit(0 if ok else 1)
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

VARIANTS_S=${GPU_SESSION_VARIANTS_S:-90}
export PY PYTHONUNBUFFERED=1   # a step killed by its timeout keeps the rows it printed
export -f versions install smoke   # run by `timeout` through bash -c
# pytest: in parallel where pytest-xdist is installed (the emulator builds and NVRTC compiles are CPU-bound);
# a hung kernel fails its test after 120 s where pytest-timeout is installed
PYTEST_ARGS=(-q -p no:cacheprovider -m "gpu and not slow" --maxfail=5 -rfE --tb=short)
if "$PY" -c "import xdist" >/dev/null 2>&1; then
    PYTEST_ARGS+=(-n "${GPU_SESSION_PYTEST_WORKERS:-12}")
fi
if "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then
    PYTEST_ARGS+=(--timeout 120 --timeout-method thread)
fi
# the forward / backward table: fp16, D 128, 256 (the twenty-fourth session's backward changes; the -mma rows: the
# twenty-fifth session's grid-layout mma.sync backward at d 256, against FA2), then 64, N 4k / 16k,
# causal and not; flasharray (the default: wgmma
# on sm_90) and its mma.sync kernels (-mma rows) against FlashAttention-2 (PyTorch's flash backend) and cuDNN;
# N 16k runs the instantiations validated at 4k. D 128 first: on the H200 of 2026-11-27 its rows took ~75 s, and
# D 64, N 1k first (the old order) used the whole budget before reaching D 128's backward
TABLE_ARGS=(--dtypes fp16 --head-dims 128,256,64 --seqlens 4096,16384 --validate-max-n 4096
    --impls "flasharray,flasharray-mma,torch-flash,torch-cudnn,flasharray-det,flasharray-atomic,flasharray-mma-det,\
flasharray-mma-atomic,flasharray-fwdbwd,torch-flash-fwdbwd,torch-cudnn-fwdbwd")
# (0) CuPy / pytest when missing (a machine without the registry: the step fails, the rest still runs)
run_step install "${GPU_SESSION_INSTALL_S:-120}" bash -c install
# (1) what machine, which versions
run_step smi "${GPU_SESSION_SMI_S:-20}" bash -c versions
# (2) one forward + backward on the GPU against the reference; nothing else runs when it fails
run_step smoke "${GPU_SESSION_SMOKE_S:-60}" bash -c smoke
if [ "$LAST_RC" != 0 ] && [ "$LAST_RC" != skipped ] && [ "${GPU_SESSION_GO_ON:-0}" != 1 ]; then
    log "gpu_session: the smoke step failed: stopping (GPU_SESSION_GO_ON=1 runs the rest anyway)"
    exit 1
fi
# (2b) host overhead per call (the packed kernel launch of 2026-11-27: first measured here)
run_step overhead "${GPU_SESSION_OVERHEAD_S:-20}" "$PY" benchmarks/overhead.py --device cuda
# (3) correctness on the GPU: every gpu test but the slow matrices and the Hopper kernels (stops after 5 failures)
run_step pytest "${GPU_SESSION_PYTEST_S:-100}" "$PY" -m pytest "${PYTEST_ARGS[@]}" \
    --junitxml="$OUT_DIR/junit.xml" --ignore=tests/test_gpu_sm90.py tests/
# (4) forward and backward tables against FlashAttention-2 and cuDNN
run_step gpu_backward "${GPU_SESSION_BACKWARD_S:-130}" "$PY" benchmarks/gpu.py --backward "${TABLE_ARGS[@]}"
# (4b) the switches that wait for a GPU's verdict (the thirty-fifth session: the d 256 backward's query split with dP^T
# behind S^T and dQ^T before the dV/dK wait, default off; the thirty-fourth: S^T ahead and four dQ buffers at d 64,
# both off; the thirty-first session: the ws forward on three consumer
# warpgroups at d 64, default off; the thirtieth session: the wgmma backward's dQ split by queries at
# d 64; the twenty-fourth session: the wgmma backward's bulk dQ, now at
# d 256 too (staged by the consumers, added by the dQ warp since the thirty-third session), its d 256 query split, timed at N 4k only, and its ordered mode's
# entries-first block order (and the mma.sync kernels'); the persistent forward at causal d 256, off since the twenty-third session on the SASS
# alone; the earlier ones were decided on the H200 of 2026-11-28, docs/gpu_h200.md, "Fifth GPU session")
run_step mma_verdicts "${GPU_SESSION_MMA_S:-170}" "$PY" benchmarks/hopper_variants.py \
    --only fwd.THREE_WARPGROUPS,bwd.DQ_SPLIT,bwd.KT_REGS,bwd.SCORES_AHEAD,bwd.SPLIT_OVERLAP,bwd.DQ_BUFFERS,bwd.DQ_BULK,bwd.QUERY_SPLIT,bwd.ENTRIES_FIRST,fwd.PERSISTENT_CAUSAL_MAX_HEAD_DIM,mma.ENTRIES_FIRST \
    --seqlens 4096,16384 --max-seconds 150 --json "$OUT_DIR/mma_verdicts.json"
# (4c) the twenty-fifth session's d 256 mma.sync tiles: the grid-layout backward against the row-tile kernel, the
# 8-warp 128 x 64 forward against 128 x 32, and the wgmma backward against the mma.sync one at d 256 (if the grid
# kernel's ordered mode beats the wgmma kernel's there, sm_90's deterministic d 256 dispatch should take it); and
# with a window, the forty-second session's d 256 extension calls on the wgmma backward against the mma.sync one
run_step mma_d256 "${GPU_SESSION_MMA256_S:-70}" "$PY" benchmarks/hopper_variants.py \
    --only mma.GRID_LAYOUT,mma.WIDE_BC64_LARGE,bwd.kernel,bwd.kernel.window --head-dims 256 --seqlens 4096 --max-seconds 55 \
    --json "$OUT_DIR/mma_d256.json"
# (5) decoding / GQA shapes against FlashAttention-2
run_step gpu_decode "${GPU_SESSION_DECODE_S:-30}" "$PY" benchmarks/gpu.py --decode
# (6) the Hopper kernels against the reference and the emulator
run_step pytest_sm90 "${GPU_SESSION_PYTEST_SM90_S:-100}" "$PY" -m pytest "${PYTEST_ARGS[@]}" \
    --junitxml="$OUT_DIR/junit_sm90.xml" tests/test_gpu_sm90.py
# (7) float32 precisions (D 64 / 128, N 4096, not causal)
run_step gpu_precision "${GPU_SESSION_PRECISION_S:-40}" "$PY" benchmarks/gpu.py --precision --dtypes fp32 --seqlens 4096 \
    --causal no
# (7b) float64 on DMMA (D 64, N 4096, not causal): issue 12's "40 % of the FP64 tensor-core peak" (the fp32 rows
# used the whole step before reaching it in both earlier sessions)
run_step gpu_fp64 "${GPU_SESSION_FP64_S:-30}" "$PY" benchmarks/gpu.py --precision --dtypes fp64 --head-dims 64 \
    --seqlens 4096 --causal no
# (7c) the same with the DMMA backward's Br = 16 tile at d 64 (cuda_backward_f64.WIDE_QUERY off: the
# twenty-first session's Br = 32 against the tile it replaced; compare the backward rows with step 7b's)
run_step gpu_fp64_br16 "${GPU_SESSION_FP64_S:-30}" "$PY" -c 'import sys; sys.path.insert(0, "benchmarks")
from flasharray._private import cuda_backward_f64
cuda_backward_f64.WIDE_QUERY = False
import gpu
sys.exit(gpu.main(sys.argv[1:]))' --precision --dtypes fp64 --head-dims 64 --seqlens 4096 --causal no
# (7h) float64 on sm_90 with m8n8k4 (cuda_forward_f64.DMMA_K16 and cuda_backward_f64.DMMA_K16 off: the
# twenty-eighth / twenty-ninth sessions' mma.m16n8k16.f64 (DMMA.16x8x16) forward / backward against the DMMA.8x8x4
# kernels they replaced; compare the forward and backward rows with step 7b's)
run_step gpu_fp64_k4 "${GPU_SESSION_FP64_S:-30}" "$PY" -c 'import sys; sys.path.insert(0, "benchmarks")
from flasharray._private import cuda_backward_f64, cuda_forward_f64
cuda_forward_f64.DMMA_K16 = False
cuda_backward_f64.DMMA_K16 = False
import gpu
sys.exit(gpu.main(sys.argv[1:]))' --precision --dtypes fp64 --head-dims 64 --seqlens 4096 --causal no
# (7d) the float32 SIMT backward (precision "ieee", float32's default backward) as one 8-warp block per SM
# (tiles_bwd.SIMT_TWO_BLOCKS off: the twenty-sixth session's two 128-register blocks against the kernel they
# replaced at D 64; compare its rows with step 7's flasharray-ieee-bwd, measured with two blocks)
run_step gpu_fp32_one_block "${GPU_SESSION_FP32_S:-25}" "$PY" -c 'import sys; sys.path.insert(0, "benchmarks")
from flasharray._private import tiles_bwd
tiles_bwd.SIMT_TWO_BLOCKS = False
import gpu
sys.exit(gpu.main(sys.argv[1:]))' --precision --dtypes fp32 --head-dims 64 --seqlens 4096 --causal both \
    --impls flasharray-ieee-bwd,torch-mem-eff-bwd
# (7e) the 3xtf32 backward with every lo plane (cuda_backward_tf32.KV_RAW off: the twenty-sixth session's raw K_j, V_j,
# dS^T tiles, 8 / 4 warps per SM at D 64 / 128 on sm_90, against the 4 / 2 of the tiles they replaced; compare with
# step 7's flasharray-3xtf32-bwd rows)
run_step gpu_3xtf32_planes "${GPU_SESSION_FP32_S:-25}" "$PY" -c 'import sys; sys.path.insert(0, "benchmarks")
from flasharray._private import cuda_backward_tf32
cuda_backward_tf32.KV_RAW = False
import gpu
sys.exit(gpu.main(sys.argv[1:]))' --precision --dtypes fp32 --head-dims 64,128 --seqlens 4096 --causal no \
    --impls flasharray-3xtf32-bwd
# (7f) the float32 forward on mma.sync (cuda_forward_tf32.WGMMA off: the twenty-seventh session's wgmma forward,
# flash_fwd_sm90_tf32.cu, against the kernel it replaced on sm_90; compare with step 7's flasharray-3xtf32 and
# flasharray-tf32 rows)
run_step gpu_fp32_fwd_mma "${GPU_SESSION_FP32_S:-25}" "$PY" -c 'import sys; sys.path.insert(0, "benchmarks")
from flasharray._private import cuda_forward_tf32
cuda_forward_tf32.WGMMA = False
import gpu
sys.exit(gpu.main(sys.argv[1:]))' --precision --dtypes fp32 --head-dims 64,128 --seqlens 4096 --causal no \
    --impls flasharray-3xtf32,flasharray-tf32
# (7g) the float32 backward on mma.sync (cuda_backward_tf32.WGMMA off: the twenty-seventh session's wgmma dK/dV kernel,
# flash_bwd_sm90_tf32.cu, D 64, against the kernel it replaced; compare with step 7's flasharray-3xtf32-bwd and
# flasharray-tf32-bwd rows)
run_step gpu_fp32_bwd_mma "${GPU_SESSION_FP32_S:-25}" "$PY" -c 'import sys; sys.path.insert(0, "benchmarks")
from flasharray._private import cuda_backward_tf32
cuda_backward_tf32.WGMMA = False
import gpu
sys.exit(gpu.main(sys.argv[1:]))' --precision --dtypes fp32 --head-dims 64 --seqlens 4096 --causal no \
    --impls flasharray-3xtf32-bwd,flasharray-tf32-bwd
# (8) extension calls: wgmma vs mma.sync with dropout / a window (sm_90's dispatch of them: AUTO_EXT)
run_step hopper_ext "${GPU_SESSION_EXT_S:-60}" "$PY" benchmarks/hopper_variants.py --only ext --seqlens 1024,4096 \
    --max-seconds "$((${GPU_SESSION_EXT_S:-60} / 2))" --json "$OUT_DIR/hopper_ext.json"
# (9) the Hopper switches on vs off (stops starting shapes 30 s before its budget, so its tables print)
left=$(remaining)
if [ "$left" -lt "$VARIANTS_S" ]; then
    VARIANTS_S=$left
fi
run_step hopper_variants "$VARIANTS_S" "$PY" benchmarks/hopper_variants.py \
    --max-seconds "$((VARIANTS_S > 60 ? VARIANTS_S - 30 : VARIANTS_S / 2))" --json "$OUT_DIR/hopper_variants.json"

log "gpu_session: done after $(($(date +%s) - START))s of ${TOTAL}s, $([ "$FAILED" -eq 0 ] && echo 'every step passed' || echo 'some step failed, timed out or was skipped')"
exit "$FAILED"
