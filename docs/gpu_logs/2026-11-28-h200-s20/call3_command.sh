#!/bin/bash
# GPU call 3 (twentieth session, an H100): the cp.async copies into padded rows (variants A / B / C, call3_exp.py run
# as .gpu/exp.py; .gpu/src_a: HEAD's cuda_src, .gpu/src_c: call3_variant_c.diff applied; B: the working tree of the
# time, whole-chunk copies by a cp.async without src-size, .L2::128B, reverted after call 4)
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PATH=$PATH:/usr/local/cuda/bin
G=/tmp/g3; mkdir -p $G
M=gpu__time_duration.sum,smsp__inst_executed_op_ldgsts.sum,sm__sass_l1tex_t_sectors_pipe_lsu_mem_global_op_ldgsts_cache_bypass.sum,smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldgsts.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__inst_executed.sum
for V in A B C; do
  case $V in A) S=$PWD/.gpu/src_a;; B) S=$PWD/cuda_src;; C) S=$PWD/.gpu/src_c;; esac
  FLASHARRAY_CUDA_SRC=$S timeout -k 5 60 python3 .gpu/exp.py $V 2>&1 | tail -3 | tee $G/time_$V.log
  FLASHARRAY_CUDA_SRC=$S NCU=1 timeout -k 5 40 ncu --clock-control none --profile-from-start off -k regex:"flash_fwd_kernel|dkv_grid" \
    --metrics $M --csv python3 .gpu/exp.py $V > $G/ncu_$V.csv 2>&1; echo "ncu $V rc $?"
done
cd $G && tar czf $OUT/g3.tgz . && python3 - <<'PY'
import csv, glob, io
for f in sorted(glob.glob("ncu_*.csv")):
    lines = open(f).read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        print(f, "no csv:", lines[-3:]); continue
    for r in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        print(f[4:5], r["Kernel Name"][:22], r["Metric Name"][:70], r["Metric Value"])
PY
