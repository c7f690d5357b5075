#!/bin/bash
# GPU call 2 (2026-11-27): the changes since call 1, checked and timed. Logs under /tmp/g2, tarred to $OUT.
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
G=/tmp/g2; mkdir -p $G
PT="python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --timeout 120 --timeout-method thread"
s() { echo "== $1 rc $2 $(date +%T)"; }
timeout -k 5 80 $PT -n 12 -m "gpu and not slow" --ignore=tests/test_gpu_sm90.py tests/ > $G/1_pytest.log 2>&1; s pytest $?
timeout -k 5 60 $PT -n 12 -m "gpu and not slow" tests/test_gpu_sm90.py > $G/2_sm90.log 2>&1; s sm90 $?
timeout -k 5 25 $PT -n 8 -k known_answers tests/test_emulator_tma.py > $G/3_tma.log 2>&1; s tma $?
timeout -k 5 25 python3 .gpu/diag_precision.py > $G/4_prec.log 2>&1; s prec $?
timeout -k 5 80 python3 benchmarks/gpu.py --backward --dtypes fp16 --head-dims 64,128 --seqlens 1024,4096 --causal yes \
  --validate-max-n 4096 --impls flasharray,flasharray-mma,torch-flash,flasharray-det,flasharray-atomic,flasharray-mma-det,flasharray-mma-atomic,torch-flash-fwdbwd,flasharray-fwdbwd > $G/5_bwd.log 2>&1; s bwd $?
timeout -k 5 40 python3 benchmarks/gpu.py --decode > $G/6_decode.log 2>&1; s decode $?
tar czf $OUT/g2.tgz -C $G .
for f in 1_pytest 2_sm90 3_tma; do echo "## $f"; grep -E "^(FAILED|ERROR)|passed|failed" $G/$f.log | cut -c1-200 | tail -15; done
echo "## prec"; cat $G/4_prec.log | cut -c1-200
echo "## bwd"; grep -E "^\(" $G/5_bwd.log | cut -c1-100
echo "## decode"; grep -E "flasharray|torch" $G/6_decode.log | cut -c1-120
