#!/usr/bin/env bash
# run 43, call 3 (one H200): the W2 DGRAD's split kernel (epilogue_warps: one MMA warpgroup,
# the epilogue in its own partition of 4 or 8 warps). Its GPU tests first (stop on a hang or
# a failure); then, beside the GPU tests call 2 did not reach, the kernel alone against the
# ping-pong production kernel (builds and checks first, timing once the tests are done);
# then the layer fwd+bwd at fine under sampled routing, base against two split variants.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o3; mkdir -p $out
t0=$SECONDS
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 60 -x \
  tests/kernels/test_backward_kernels.py -k "split_epilogue" > $out/t_split.log 2>&1
rc=$?; echo "split tests rc=$rc at $((SECONDS - t0)) s"; tail -n 15 $out/t_split.log | cut -c1-300
(timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/routing tests/runtime tests/tools \
   > $out/t_rest.log 2>&1; echo "rest rc=$?" >> $out/t_rest.log) &
P=$!
if [ $rc -eq 0 ]; then
  timeout 230 python3 docs/perf/2026-12-01-h200-run42/w2d_prefetch_micro.py --wait-pid $P \
    fine:prod=4/0,e4=5/0/4/1,e8=4/0/8/1,e8s5=5/0/8/1,e8b2=3/0/8/2 \
    olmoe:prod=4/0,e8=4/0/8/1,e8b2=3/0/8/2 issue-b:prod=4/0,e8=4/0/8/1 \
    issue-a:prod=5/0,e8s5=5/0/8/1,e8b2=3/0/8/2 > $out/micro.log 2>&1
  echo "micro rc=$? at $((SECONDS - t0)) s"; grep -v "built and run" $out/micro.log | tail -n 8
fi
wait $P; tail -n 3 $out/t_rest.log
if [ $rc -eq 0 ]; then
  left=$((560 - (SECONDS - t0)))
  timeout $left python3 tools/ab_interleaved.py --mode fwdbwd --shape fine --routing sampled \
    --rounds 7 --iters 10 --variant e8=w2_dgrad:epilogue_warps=8,num_stages=4 \
    --variant e8b2=w2_dgrad:epilogue_warps=8,epilogue_buffers=2,num_stages=3 > $out/ab_fine.log 2>&1
  echo "ab rc=$? at $((SECONDS - t0)) s"; grep -E "^ +(base|e8|e8b2) " $out/ab_fine.log
fi
tar czf /tmp/g3.tgz -C $out . && cp /tmp/g3.tgz $OUT/
