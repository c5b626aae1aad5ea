#!/usr/bin/env bash
# run 49, call 4 (one H200): the GPT-OSS shapes where this run's partial tiles newly reach
# the Gluon kernels without a measurement behind the pick: inference at decode (T = 64:
# 2 / 8 rows per expert) and at 64 rows per expert (T = 2048 at 120b, 512 at 20b), each
# kernel against its Triton pick, interleaved (the printed configs say which ran); then the
# suite's four shapes (no D or F off 128: the same PTX as before this run) against torch.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
W13TRI="w13:inference:gluon=False"
W2TRI="w2:gluon=False,block_n=256,num_warps=8,num_stages=4"
for spec in "gpt-oss-120b 64" "gpt-oss-120b 2048" "gpt-oss-20b 64" "gpt-oss-20b 512"; do
  set -- $spec
  left=$((300 - (SECONDS - t0))); [ $left -lt 40 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwd --tokens $2 --rounds 9 \
    --variant "w13tri=$W13TRI" --variant "w2tri=$W2TRI" --variant "both=$W13TRI+$W2TRI" \
    > $OUT/ab_$1_T$2.log 2>&1
  echo "ab $1 T=$2 rc=$? at $((SECONDS - t0)) s"; grep -E "_w13_cfg = |_w2_cfg = |^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_T$2.log | sed 's/, host_descriptors.*, gluon/ .. gluon/' | cut -c1-150
done
left=$((585 - (SECONDS - t0)))
if [ $left -gt 90 ]; then
  timeout $left python3 -m distmoe bench --mode fwdbwd --providers distmoe torch --no-plots \
    --out $OUT/bench > $OUT/bench.log 2>&1
  echo "bench rc=$? at $((SECONDS - t0)) s"; grep -E "^(distmoe|torch) |ceiling dense" $OUT/bench.log
fi
