#!/usr/bin/env bash
# run 55, call 3: the fwd+bwd bench against the torch baseline after run 54's WGRAD pick (the
# 256 x 128 tiles from 12 MiB per expert), exact routing first (issue 7's targets), then
# sampled; ceilings in the same run. Then, in what time is left, Nsight Compute's memory
# tables for the plain and wide WGRADs at 128 rows per expert (where the wide one reads its
# inputs from DRAM 4.4 times, call 2)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
d=docs/perf/2026-12-05-run55
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
for routing in exact sampled; do
  left=$((${BUDGET:-560} - (SECONDS - t0))); [ $left -lt 90 ] && break
  timeout $left python3 -m distmoe bench --mode fwdbwd --shapes deepseek-v3 issue-a fine \
    --routing $routing --providers distmoe torch --no-plots --out $OUT/bench_$routing \
    > $OUT/bench_$routing.log 2>&1
  echo "bench $routing rc=$? at $((SECONDS - t0)) s"
  grep -E "^(distmoe|torch|ceiling dense|ceiling device)" $OUT/bench_$routing.log | cut -c1-140 | head -12
done
for cfg in wide plain; do
  left=$((${BUDGET:-560} - (SECONDS - t0))); [ $left -lt 40 ] && break
  timeout $left ncu --clock-control none -k regex:_gluon_wgrad --launch-skip 1 --launch-count 1 \
    --section MemoryWorkloadAnalysis_Tables --section MemoryWorkloadAnalysis_Chart \
    --metrics dram__bytes_write.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_write.sum,lts__t_sectors_srcunit_ltcfabric.sum \
    python3 $d/wgrad_probe.py --experts 64 --config $cfg --kernel w13 > $OUT/ncu_mem_$cfg.log 2>&1
  echo "ncu $cfg rc=$? at $((SECONDS - t0)) s"
  grep -E "dram__bytes|lookup_miss|lookup_hit|fabric" $OUT/ncu_mem_$cfg.log | head -8
done
