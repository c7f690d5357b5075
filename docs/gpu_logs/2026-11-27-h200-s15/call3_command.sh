#!/bin/bash
# GPU call 3 (fifteenth session): decode with the 95 % split rule; fp32 d 128 per precision; wgmma vs mma.sync
# forward with a window at N 4096. Logs under /tmp/g3, tarred to $OUT.
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
G=/tmp/g3; mkdir -p $G
s() { echo "== $1 rc $2 $(date +%T)"; }
T0=$(date +%s)
timeout -k 5 40 python3 benchmarks/gpu.py --decode > $G/1_decode.log 2>&1; s decode $?
timeout -k 5 60 python3 benchmarks/gpu.py --precision --dtypes fp32 --head-dims 128 --seqlens 4096 --causal no \
  --impls flasharray-ieee,flasharray-ieee-bwd,flasharray-ieee-fwdbwd,flasharray-3xtf32,flasharray-3xtf32-bwd,flasharray-3xtf32-fwdbwd,torch-mem-eff,torch-mem-eff-bwd,torch-mem-eff-fwdbwd \
  > $G/2_precision128.log 2>&1; s precision128 $?
timeout -k 5 35 python3 benchmarks/hopper_variants.py --only fwd.kernel.window --seqlens 4096 --max-seconds 20 \
  --json $G/window.json > $G/3_window.log 2>&1; s window $?
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/g3.tgz -C $G .
echo "## decode"; grep -E "flasharray|torch|FAIL|Error" $G/1_decode.log | cut -c1-120
echo "## prec128"; grep -E "^\(|goal|default|>=|FAIL" $G/2_precision128.log | cut -c1-110
echo "## window"; grep -vE "^\s*$" $G/3_window.log | cut -c1-130 | tail -16
