#!/bin/bash
# GPU call 1 (2026-11-28, twentieth session): sessions 16-19's mma.sync changes on hardware (grid-layout backward,
# 128 x 64 forward tile, single-buffered copies, sm_75 / sm_86 code on a newer GPU), the Hopper kernels' regression
# tests, the table at D 128 / 64, the mma switches, window1k, float64. Logs under /tmp/g1, tarred to $OUT.
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
G=/tmp/g1; mkdir -p $G
PT="python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --timeout 120 --timeout-method thread"
s() { echo "== $1 rc $2 $(date +%T)"; }
T0=$(date +%s)
nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.max.sm --format=csv > $G/0_smi.log 2>&1
python3 -c "import cupy, numpy, torch; print(cupy.__version__, numpy.__version__, torch.__version__)" >> $G/0_smi.log 2>&1; s smi $?
timeout -k 5 95 $PT -n 14 --maxfail 25 -m "gpu and not slow" --ignore=tests/test_gpu_sm90.py \
  --ignore=tests/test_emulator_tma.py --ignore=tests/test_emulator_wgmma.py tests/ > $G/1_pytest.log 2>&1; s pytest $?
timeout -k 5 55 $PT -n 14 --maxfail 25 -m "gpu and not slow" tests/test_gpu_sm90.py > $G/2_sm90.log 2>&1; s sm90 $?
IMPLS=flasharray,flasharray-mma,torch-flash,torch-cudnn,flasharray-det,flasharray-atomic,flasharray-mma-det,flasharray-mma-atomic,flasharray-fwdbwd,torch-flash-fwdbwd,torch-cudnn-fwdbwd
timeout -k 5 85 python3 benchmarks/gpu.py --backward --dtypes fp16 --head-dims 128 --seqlens 4096,16384 \
  --validate-max-n 4096 --impls $IMPLS > $G/3_bwd128.log 2>&1; s bwd128 $?
timeout -k 5 45 python3 benchmarks/gpu.py --backward --dtypes fp16 --head-dims 64 --seqlens 4096 \
  --validate-max-n 4096 --impls $IMPLS > $G/4_bwd64.log 2>&1; s bwd64 $?
timeout -k 5 80 python3 benchmarks/hopper_variants.py --only mma.GRID_LAYOUT,mma.WIDE_BC64,mma.WIDE_CAUSAL \
  --seqlens 4096 --max-seconds 50 --json $G/mma_variants.json > $G/5_mma_variants.log 2>&1; s mma_variants $?
timeout -k 5 30 python3 benchmarks/hopper_variants.py --only fwd.kernel.window1k --seqlens 4096 --max-seconds 15 \
  --json $G/window1k.json > $G/6_window1k.log 2>&1; s window1k $?
timeout -k 5 30 python3 benchmarks/gpu.py --precision --dtypes fp64 --head-dims 64 --seqlens 4096 --causal no \
  > $G/7_fp64.log 2>&1; s fp64 $?
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/g1.tgz -C $G .
for f in 1_pytest 2_sm90; do echo "## $f"; grep -E "^(FAILED|ERROR)|passed|failed" $G/$f.log | cut -c1-160 | tail -14; done
echo "## bwd"; cat $G/3_bwd128.log $G/4_bwd64.log | grep -E "^\(|FAIL|Error" | cut -c1-104 | head -90
echo "## mma"; grep -vE "^\s*$|^---" $G/5_mma_variants.log | cut -c1-124 | tail -40
echo "## window1k"; grep -vE "^\s*$|^---" $G/6_window1k.log | cut -c1-124 | tail -12
echo "## fp64"; grep -vE "^\s*$" $G/7_fp64.log | cut -c1-140 | tail -12
