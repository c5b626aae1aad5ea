#!/usr/bin/env bash
# call 3 (x2): fine (41 rounds), x in the input buffer alone and with W13 in two launches
# (own blocks while the copy runs; 1 or 2 waves first) and with the fused kernel; then
# deepseek-v3 (11 rounds; layer_step now draws the weights on the GPU: call 2's setup ran
# past 170 s)
set -u
out=/tmp/o3; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share --variant inbuf=input:buffer=True"
timeout 200 $R --shape fine --rounds 41 --variant inbuf_ph1=input:buffer=True+layer:w13_phases=True+layer:w13_waves=1 --variant inbuf_ph2=input:buffer=True+layer:w13_phases=True+layer:w13_waves=2 --variant inbuf_fused=input:buffer=True+layer:fused=True > $out/ab_fine.log 2>&1
echo "ab fine rc=$?"; grep -v "^\*\|OMP" $out/ab_fine.log | tail -6
timeout 300 $R --shape deepseek-v3 --rounds 11 > $out/ab_deepseek-v3.log 2>&1
echo "ab deepseek-v3 rc=$?"; grep -v "^\*\|OMP" $out/ab_deepseek-v3.log | tail -3
tar czf /tmp/g3.tgz -C $out . && cp /tmp/g3.tgz $OUT/
