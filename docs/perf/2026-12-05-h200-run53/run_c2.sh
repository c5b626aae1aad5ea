#!/usr/bin/env bash
# run 53, call 2 (one H100): the DGRAD kernels alone with and without lockstep (call 1's
# micro lost the W13 row tables to the allocator after capture: fixed), then the layer's
# fwd+bwd, interleaved, sampled routing, with the W2 DGRAD in lockstep and the W13 DGRAD on
# the Gluon kernel in lockstep (gpt-oss-120b: the heuristic's W13 DGRAD is Triton there;
# issue-b: Gluon, so lockstep alone)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
d=docs/perf/2026-12-05-h200-run53
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout 300 python3 $d/dgrad_micro.py --rounds 11 deepseek-v3 gpt-oss-120b issue-b fine \
  deepseek-v4-flash > $OUT/micro.log 2>&1
echo "micro rc=$? at $((SECONDS - t0)) s"; grep -v "^\s*$" $OUT/micro.log | tail -n 16
g="w13_dgrad:gluon=True,block_n=128,num_warps=4,num_stages=5,lockstep=True"
for spec in "gpt-oss-120b w2ls=w2_dgrad:lockstep=True w13gls=$g" \
            "issue-b w2ls=w2_dgrad:lockstep=True w13ls=w13_dgrad:lockstep=True"; do
  set -- $spec
  left=$((560 - (SECONDS - t0))); [ $left -lt 40 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing sampled \
    --rounds 9 --variant $2 --variant $3 > $OUT/ab_$1.log 2>&1
  echo "ab $1 rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1.log | head -3
done
