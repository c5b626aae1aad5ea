#!/usr/bin/env bash
# run 44, call 6 (one H200): A/A checks of the interleaved layer A/B. Call 5's deepseek-v3 run
# read a variant identical to the base 5.7% slower (3 rounds); here an identical variant (aa)
# beside the Gluon W13 DGRAD (g6) at deepseek-v3 sampled (a first try with two identical
# variants and g6 ran out of memory: four graphs of the layer), and two identical variants at
# fine exact (run once, kept from the first try)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o6; mkdir -p $out
t0=$SECONDS
SAME="w13_dgrad:group_m=8"
G6="w13_dgrad:gluon=True,block_n=128,num_warps=4,num_stages=6,dynamic=False,pair_tails=False"
python3 tools/ab_interleaved.py --mode fwdbwd --iters 10 --shape deepseek-v3 --routing sampled --rounds 7 \
  --variant aa=$SAME --variant g6=$G6 > $out/ab_dsv3.log 2>&1
echo "dsv3 rc=$? at $((SECONDS - t0)) s"; grep -E "^ +(base|aa|ab|g6) " $out/ab_dsv3.log
if [ "${FINE:-0}" = 1 ]; then
python3 tools/ab_interleaved.py --mode fwdbwd --iters 10 --shape fine --routing exact --rounds 9 \
  --variant aa=$SAME --variant ab=$SAME > $out/ab_fine.log 2>&1
echo "fine rc=$? at $((SECONDS - t0)) s"; grep -E "^ +(base|aa|ab) " $out/ab_fine.log
fi
tar czf /tmp/g6b.tgz -C $out . && cp /tmp/g6b.tgz $OUT/
