#!/usr/bin/env bash
# run 55, call 7 (one H100): the warp-specialised WGRAD's producers in lockstep
# (WgradConfig.lockstep, off by default), against call 3's 3.4x L2 misses: the kernels alone
# at 128 rows per expert, the layer at DeepSeek-V3 (both routings), the GPU tests, then
# V4-Flash and issue-a and Nsight Compute's L2 counters in what time is left
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
d=docs/perf/2026-12-05-run55
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout 60 python3 $d/wgrad_probe.py --time --config plain wide widels pp ppls > $OUT/probe.log 2>&1
echo "probe rc=$? at $((SECONDS - t0)) s"; tail -n 11 $OUT/probe.log
ab() {  # shape routing
  left=$((${DEADLINE:-330} - (SECONDS - t0))); [ $left -lt 25 ] && return
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 \
    --rounds 7 --variant ls=wgrad:lockstep=True > $OUT/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(|Error" $OUT/ab_$1_$2.log | head -2
}
ab deepseek-v3 exact
ab deepseek-v3 sampled
left=$((${DEADLINE:-330} - 20 - (SECONDS - t0))); [ $left -gt 170 ] && left=170
timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -rfE \
  tests/kernels/test_backward_kernels.py \
  -k "test_gluon_wgrad_lockstep or (test_gluon_wgrad and 256x128 and ws and 3_programs) or (test_gluon_wgrad_x_rows and 256x128)" \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 1 $OUT/tests.log
ab deepseek-v4-flash sampled
ab issue-a exact
left=$((${DEADLINE:-330} + 10 - (SECONDS - t0)))
if [ $left -gt 20 ]; then
  timeout $left ncu --clock-control none -k regex:_gluon_wgrad --launch-skip 1 --launch-count 1 \
    --metrics dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,gpu__time_duration.sum \
    python3 $d/wgrad_probe.py --experts 64 --config widels --kernel w13 > $OUT/ncu_widels.log 2>&1
  echo "ncu rc=$? at $((SECONDS - t0)) s"; grep -E "dram__|lookup_miss|duration" $OUT/ncu_widels.log
fi
