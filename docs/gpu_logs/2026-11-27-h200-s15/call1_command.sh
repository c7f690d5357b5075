#!/bin/bash
# GPU call 1 (2026-11-27, fifteenth session): sessions 13-14's changes on hardware. Logs under /tmp/g1, tarred to $OUT.
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
G=/tmp/g1; mkdir -p $G
PT="python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --timeout 120 --timeout-method thread"
s() { echo "== $1 rc $2 $(date +%T)"; }
T0=$(date +%s)
nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.max.sm --format=csv > $G/0_smi.log 2>&1
python3 -c "import cupy, numpy, torch; print(cupy.__version__, numpy.__version__, torch.__version__)" >> $G/0_smi.log 2>&1; s smi $?
timeout -k 5 95 $PT -n 14 --maxfail 25 -m "gpu and not slow" --ignore=tests/test_gpu_sm90.py \
  --ignore=tests/test_emulator_tma.py --ignore=tests/test_emulator_wgmma.py tests/ > $G/1_pytest.log 2>&1; s pytest $?
timeout -k 5 70 $PT -n 14 --maxfail 25 -m "gpu and not slow" tests/test_gpu_sm90.py > $G/2_sm90.log 2>&1; s sm90 $?
timeout -k 5 30 $PT -n 16 -m gpu tests/test_emulator_tma.py tests/test_emulator_wgmma.py > $G/3_kat.log 2>&1; s kat $?
timeout -k 5 20 python3 benchmarks/overhead.py --device cuda > $G/4_overhead.log 2>&1; s overhead $?
IMPLS=flasharray,flasharray-mma,torch-flash,torch-cudnn,flasharray-det,flasharray-atomic,flasharray-mma-det,flasharray-mma-atomic,flasharray-fwdbwd,torch-flash-fwdbwd,torch-cudnn-fwdbwd
timeout -k 5 85 python3 benchmarks/gpu.py --backward --dtypes fp16 --head-dims 128 --seqlens 4096,16384 \
  --validate-max-n 4096 --impls $IMPLS > $G/5_bwd128.log 2>&1; s bwd128 $?
timeout -k 5 45 python3 benchmarks/gpu.py --backward --dtypes fp16 --head-dims 64 --seqlens 4096 \
  --validate-max-n 4096 --impls $IMPLS > $G/5_bwd64.log 2>&1; s bwd64 $?
timeout -k 5 45 python3 benchmarks/gpu.py --decode > $G/6_decode.log 2>&1; s decode $?
timeout -k 5 45 python3 benchmarks/gpu.py --precision --seqlens 4096 --causal no > $G/7_precision.log 2>&1; s precision $?
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/g1.tgz -C $G .
for f in 1_pytest 2_sm90 3_kat; do echo "## $f"; grep -E "^(FAILED|ERROR)|passed|failed" $G/$f.log | cut -c1-160 | tail -14; done
echo "## overhead"; tail -12 $G/4_overhead.log | cut -c1-140
echo "## bwd"; cat $G/5_bwd128.log $G/5_bwd64.log | grep -E "^\(|FAIL|Error" | cut -c1-104 | head -90
echo "## decode"; grep -E "flasharray|torch|FAIL|Error" $G/6_decode.log | cut -c1-120 | head -20
echo "## precision"; grep -vE "^\s*$" $G/7_precision.log | cut -c1-140 | tail -25
