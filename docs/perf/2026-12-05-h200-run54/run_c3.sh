#!/usr/bin/env bash
# run 54, call 3 (one H100): call 2's deepseek-v3 A/B ran out of memory with 35 GiB reserved
# but unallocated, so again with expandable segments; then the last 35 of run 53's call-6
# kernel tests (call 2 reached 63 of its 90 in 300 s with -n 4, none failed), verbosely
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout ${AB_BUDGET:-240} \
  python3 tools/ab_interleaved.py --shape deepseek-v3 --mode fwdbwd \
  --routing sampled --rounds 7 --variant off=w2_dgrad:lockstep=False \
  > $OUT/ab_deepseek-v3_sampled.log 2>&1
echo "ab deepseek-v3 sampled rc=$? at $((SECONDS - t0)) s"
grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_deepseek-v3_sampled.log | head -3
tail -n 2 $OUT/ab_deepseek-v3_sampled.log
left=$((570 - (SECONDS - t0)))
timeout $left python3 -m pytest -v -p no:cacheprovider -n 4 --timeout 240 -rfE \
  $(cat docs/perf/2026-12-05-h200-run54/c3_ids.txt) > $OUT/kernels_tail.log 2>&1
echo "kernels tail rc=$? at $((SECONDS - t0)) s"; tail -n 1 $OUT/kernels_tail.log
grep -cE " PASSED " $OUT/kernels_tail.log; grep -E "(FAILED|ERROR)" $OUT/kernels_tail.log | head -10
