#!/bin/bash
# GPU call 2 (fifteenth session): the tensor-map address patch on hardware, wgmma vs mma.sync with extensions,
# decode split counts, 3xtf32 errors. Logs under /tmp/g2, tarred to $OUT.
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
G=/tmp/g2; mkdir -p $G
PT="python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --timeout 120 --timeout-method thread"
s() { echo "== $1 rc $2 $(date +%T)"; }
T0=$(date +%s)
timeout -k 5 70 $PT -n 14 --maxfail 25 -m "gpu and not slow" tests/test_gpu_sm90.py tests/test_cuda_backward_sm90_extensions.py \
  tests/test_cuda_forward_sm90_extensions.py tests/test_kvcache.py > $G/1_sm90.log 2>&1; s sm90 $?
timeout -k 5 20 python3 benchmarks/overhead.py --device cuda > $G/2_overhead.log 2>&1; s overhead $?
timeout -k 5 45 python3 .gpu/decode_sweep.py > $G/3_decode_sweep.log 2>&1; s decode_sweep $?
timeout -k 5 65 python3 benchmarks/hopper_variants.py --only ext --seqlens 1024,4096 --max-seconds 40 \
  --json $G/hopper_ext.json > $G/4_hopper_ext.log 2>&1; s hopper_ext $?
timeout -k 5 40 python3 .gpu/prec_sweep.py > $G/5_prec_sweep.log 2>&1; s prec_sweep $?
timeout -k 5 40 python3 benchmarks/gpu.py --precision --head-dims 128 --seqlens 4096 --causal no > $G/6_precision128.log 2>&1; s precision128 $?
timeout -k 5 35 python3 benchmarks/gpu.py --backward --dtypes fp16 --head-dims 64 --seqlens 4096 --causal yes \
  --validate-max-n 4096 --impls flasharray,flasharray-mma,torch-flash,torch-cudnn,flasharray-det,flasharray-atomic,flasharray-mma-det,flasharray-mma-atomic > $G/7_bwd64c.log 2>&1; s bwd64c $?
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/g2.tgz -C $G .
echo "## sm90"; grep -E "^(FAILED|ERROR)|passed|failed" $G/1_sm90.log | cut -c1-160 | tail -12
echo "## overhead"; head -14 $G/2_overhead.log | cut -c1-120
echo "## decode"; cat $G/3_decode_sweep.log | cut -c1-120
echo "## ext"; grep -vE "^\s*$" $G/4_hopper_ext.log | cut -c1-130 | tail -45
echo "## prec"; cut -c1-150 $G/5_prec_sweep.log
echo "## prec128"; grep -E "^\(" $G/6_precision128.log | cut -c1-100
echo "## bwd64c"; grep -E "^\(" $G/7_bwd64c.log | cut -c1-100
