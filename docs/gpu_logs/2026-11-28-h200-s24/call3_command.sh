#!/bin/bash
# GPU call 3 (2026-11-28, twenty-fourth session): the d 256 backward's query split (cuda_backward_sm90.QUERY_SPLIT)
# on hardware: the Hopper GPU tests (the new ws_dup_scores variant too), its switch, the d 256 backward table; then
# the wide key tiles against the narrow ones at N 1k / 2k / 8k with the rule forced on (WIDE_KEY_COST 0: every
# dense shape takes the wide tile), to fit the rule to (with call 1's 4k / 16k) five lengths per head dim.
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
G=/tmp/g3; mkdir -p $G
PT="python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --timeout 120 --timeout-method thread"
s() { echo "== $1 rc $2 $(date +%T) +$(( $(date +%s) - T0 ))s"; }
T0=$(date +%s)
timeout -k 5 90 $PT -n 14 --maxfail 25 -m "gpu and not slow" tests/test_gpu_sm90.py > $G/1_sm90.log 2>&1; s sm90 $?
timeout -k 5 50 python3 benchmarks/gpu_backward.py --dtypes fp16 --head-dims 256 --seqlens 4096,16384 \
  --validate-max-n 4096 --impls flasharray-det,flasharray-atomic,torch-flash,torch-cudnn > $G/2_bwd256.log 2>&1; s bwd256 $?
timeout -k 5 50 python3 benchmarks/hopper_variants.py --only bwd.QUERY_SPLIT --seqlens 4096,16384 --max-seconds 35 \
  --json $G/qsplit.json > $G/3_qsplit.log 2>&1; s qsplit $?
timeout -k 5 75 python3 -c 'import sys; sys.path.insert(0, "benchmarks")
from flasharray._private import cuda_forward_sm90 as F
F.WIDE_KEY_COST = {d: 0.0 for d in F.WIDE_KEY_COST}
import hopper_variants
sys.exit(hopper_variants.main(sys.argv[1:]))' --only fwd.WIDE_KEYS --seqlens 1024,2048,8192 --max-seconds 60 \
  --json $G/wide_sweep.json > $G/4_wide_sweep.log 2>&1; s wide_sweep $?
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/g3.tgz -C $G .
echo "## 1_sm90"; grep -E "^(FAILED|ERROR)|passed|failed" $G/1_sm90.log | cut -c1-160 | tail -14
echo "## bwd256"; grep -E "^\(|FAIL|Error" $G/2_bwd256.log | cut -c1-110
echo "## qsplit"; grep -vE "^\s*$|^---" $G/3_qsplit.log | cut -c1-130 | tail -14
echo "## wide"; grep -vE "^\s*$|^---" $G/4_wide_sweep.log | cut -c1-130 | tail -22
