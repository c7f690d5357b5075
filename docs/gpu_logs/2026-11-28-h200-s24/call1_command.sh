#!/bin/bash
# GPU call 1 (2026-11-28, twenty-fourth session): sessions 21-23's changes on hardware. The Hopper GPU tests first
# (wide key tiles, sO over the V ring, d 256 persistent, head dims padded to 192: none has run on a GPU), the other
# GPU tests, then the verdicts: fwd.WIDE_KEYS, fwd.PERSISTENT_MAX_HEAD_DIM, fwd.CAUSAL_PAIRS, bwd.KV_REGS,
# mma.GRID_SWIZZLE, mma.CAUSAL_GROUPS; the table against FA2 / cuDNN at D 128 / 64 / 256; float64 (Br 32 vs 16).
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
G=/tmp/g1; mkdir -p $G
PT="python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --timeout 120 --timeout-method thread"
s() { echo "== $1 rc $2 $(date +%T) +$(( $(date +%s) - T0 ))s"; }
T0=$(date +%s)
nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.max.sm --format=csv > $G/0_smi.log 2>&1
python3 -c "import cupy, numpy, torch; print(cupy.__version__, numpy.__version__, torch.__version__)" >> $G/0_smi.log 2>&1; s smi $?
timeout -k 5 90 $PT -n 14 --maxfail 25 -m "gpu and not slow" tests/test_gpu_sm90.py > $G/1_sm90.log 2>&1; s sm90 $?
timeout -k 5 70 $PT -n 14 --maxfail 25 -m "gpu and not slow" --ignore=tests/test_gpu_sm90.py \
  --ignore=tests/test_emulator_tma.py --ignore=tests/test_emulator_wgmma.py tests/ > $G/2_pytest.log 2>&1; s pytest $?
timeout -k 5 110 python3 benchmarks/hopper_variants.py --only fwd.WIDE_KEYS,fwd.PERSISTENT_MAX_HEAD_DIM,fwd.CAUSAL_PAIRS,bwd.KV_REGS \
  --seqlens 4096,16384 --max-seconds 80 --json $G/fwd_variants.json > $G/3_fwd_variants.log 2>&1; s fwd_variants $?
timeout -k 5 60 python3 benchmarks/hopper_variants.py --only mma.GRID_SWIZZLE,mma.CAUSAL_GROUPS \
  --seqlens 4096,16384 --max-seconds 40 --json $G/mma_variants.json > $G/4_mma_variants.log 2>&1; s mma_variants $?
timeout -k 5 100 python3 benchmarks/gpu.py --backward --dtypes fp16 --head-dims 128,256,64 --seqlens 4096,16384 \
  --validate-max-n 4096 --impls flasharray,torch-flash,torch-cudnn,flasharray-det,flasharray-atomic > $G/5_table.log 2>&1; s table $?
timeout -k 5 25 python3 benchmarks/gpu.py --precision --dtypes fp64 --head-dims 64 --seqlens 4096 --causal no \
  > $G/6_fp64.log 2>&1; s fp64 $?
timeout -k 5 25 python3 -c 'import sys; sys.path.insert(0, "benchmarks")
from flasharray._private import cuda_backward_f64
cuda_backward_f64.WIDE_QUERY = False
import gpu
sys.exit(gpu.main(sys.argv[1:]))' --precision --dtypes fp64 --head-dims 64 --seqlens 4096 --causal no > $G/7_fp64_br16.log 2>&1; s fp64_br16 $?
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/g1.tgz -C $G .
for f in 1_sm90 2_pytest; do echo "## $f"; grep -E "^(FAILED|ERROR)|passed|failed" $G/$f.log | cut -c1-160 | tail -14; done
echo "## variants"; cat $G/3_fwd_variants.log $G/4_mma_variants.log | grep -vE "^\s*$|^---" | grep -vE "^\(|^shape" | cut -c1-130 | tail -40
echo "## table"; grep -E "^\(|FAIL|Error" $G/5_table.log | cut -c1-104 | head -60
echo "## fp64"; cat $G/6_fp64.log $G/7_fp64_br16.log | grep -vE "^\s*$" | cut -c1-140 | tail -16
