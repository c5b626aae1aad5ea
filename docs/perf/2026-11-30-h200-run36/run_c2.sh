#!/usr/bin/env bash
# call 2 (x2): the fused kernel's lag at fine (cooperative and ping-pong), then issue-a
set -u
out=/tmp/o2; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share"
F=layer:fused=True
timeout 240 $R --shape fine --rounds 21 --variant pp2=$F+layer:fused_pp=True --variant pp3=$F+layer:fused_pp=True+layer:fused_lag=3 --variant pp4=$F+layer:fused_pp=True+layer:fused_lag=4 --variant coop3=$F+layer:fused_lag=3 --variant coop4=$F+layer:fused_lag=4 --variant coop6=$F+layer:fused_lag=6 > $out/ab_fine.log 2>&1
echo "ab fine rc=$?"; grep -v "^\*\|OMP" $out/ab_fine.log | tail -9
timeout 240 $R --shape issue-a --rounds 11 --variant coop2=$F --variant coop3=$F+layer:fused_lag=3 --variant pp3=$F+layer:fused_pp=True+layer:fused_lag=3 > $out/ab_issuea.log 2>&1
echo "ab issue-a rc=$?"; grep -v "^\*\|OMP" $out/ab_issuea.log | tail -6
tar czf /tmp/g2.tgz -C $out . && cp /tmp/g2.tgz $OUT/
