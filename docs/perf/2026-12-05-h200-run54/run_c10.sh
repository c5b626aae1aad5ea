#!/usr/bin/env bash
# run 54, call 10 (one H100): call 9 timed the heuristic's WGRAD (Gluon, warp-specialised,
# ping-pong, 5 stages) the slowest of the Gluon configs at deepseek-v3 on this H100, 1.85x
# the plain persistent Gluon kernel (128x128, k64, 4 stages, 4 warps) with 128 rows for
# every expert, 1.40x under random routing (do_bench, sequential). The layer, interleaved:
# the heuristic against that plain config for both WGRADs, deepseek-v3 then fine and issue-a;
# then the WGRAD kernels alone at fine and issue-a
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
plain=wgrad:specialized=False,pingpong=False,num_stages=4,num_warps=4
ab() {  # shape routing rounds
  timeout 120 python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 \
    --rounds $3 --variant plain=$plain > $OUT/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_$2.log | head -2
}
ab deepseek-v3 sampled 9
ab deepseek-v3 exact 9
ab fine sampled 9
ab issue-a sampled 7
ab fine exact 9
left=$((${BUDGET:-420} - (SECONDS - t0)))
[ $left -gt 40 ] && timeout $left python3 tools/tune_wgrad.py --shapes fine issue-a \
  --routing balanced random --quick --csv $OUT/wgrad_fine_issue-a.csv > $OUT/wgrad_fine_issue-a.log 2>&1
echo "tune_wgrad rc=$? at $((SECONDS - t0)) s"
grep -E "^\S+ \(|HEURISTIC|^ +[0-9.]+ ms .* (w4 GLUON|GLUON WS) err" $OUT/wgrad_fine_issue-a.log | head -60
