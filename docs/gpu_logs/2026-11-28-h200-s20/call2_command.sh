#!/bin/bash
# GPU call 2 (2026-11-28, twentieth session): causal mma.sync forward calls on sm_90 take the wide tiles
# (tiles.WIDE_CAUSAL_ARCHS), at d = dv <= 128 FlashAttention-2's 128 x 64 (tiles.WIDE_BC64_CAUSAL): the forward GPU
# tests, both switches at N 1k / 4k / 16k, the table's causal mma.sync rows against FA2 (fp16 / bf16, d 96 / 128);
# Nsight Compute (an H100: Firecracker, where ncu reads counters) on the mma.sync kernels and FA2's (call2_ncu.py).
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PATH=$PATH:/usr/local/cuda/bin
G=/tmp/g2; mkdir -p $G
PT="python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --timeout 120 --timeout-method thread"
s() { echo "== $1 rc $2 $(date +%T)"; }
T0=$(date +%s)
timeout -k 5 60 $PT -n 14 --maxfail 25 -m "gpu and not slow" tests/test_cuda_forward.py tests/test_splitkv.py \
  tests/test_kvcache.py > $G/1_pytest.log 2>&1; s pytest $?
timeout -k 5 100 python3 benchmarks/hopper_variants.py --only mma.WIDE_BC64_CAUSAL,mma.WIDE_CAUSAL \
  --seqlens 1024,4096,16384 --max-seconds 70 --json $G/causal_variants.json > $G/2_causal_variants.log 2>&1; s variants $?
timeout -k 5 60 python3 benchmarks/gpu.py --dtypes fp16,bf16 --head-dims 128,96 --seqlens 2048,8192 \
  --causal yes --validate-max-n 2048 --impls flasharray-mma,torch-flash > $G/3_causal_table.log 2>&1; s table $?
timeout -k 5 110 ncu --clock-control none --set full --profile-from-start off -k regex:flash -f -o $G/ncu \
  python3 docs/gpu_logs/2026-11-28-h200-s20/call2_ncu.py > $G/4_ncu.log 2>&1; s ncu $?
ncu -i $G/ncu.ncu-rep --page details > $G/ncu_details.txt 2>&1
ncu -i $G/ncu.ncu-rep --page raw --csv > $G/ncu_raw.csv 2>&1; s ncu_export $?
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/g2.tgz -C $G --exclude ncu.ncu-rep .
echo "## pytest"; grep -E "^(FAILED|ERROR)|passed|failed" $G/1_pytest.log | cut -c1-160 | tail -14
echo "## variants"; grep -vE "^\s*$|^---" $G/2_causal_variants.log | cut -c1-124 | tail -40
echo "## table"; grep -E "^\(|FAIL|Error" $G/3_causal_table.log | cut -c1-104 | head -40
echo "## ncu"; tail -5 $G/4_ncu.log | cut -c1-200; grep -E "^  [a-z_:]*flash|Duration|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy" $G/ncu_details.txt | cut -c1-150 | head -60
