#!/usr/bin/env bash
# call 8 (two H200s): main with the ping-pong WGRAD (63896f3). Two-GPU training tests; the
# layer fwd+bwd at EP=2 against the old WGRAD pick (fine, sampled); the bench at EP=1, both
# modes, the five suite shapes, both routings (the README table); the WGRAD alone at
# issue-a (plain 128 x 256 pick) against the ping-pong form.
set -u
out=/tmp/o8; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $out/gpu.txt
git status --short > $out/status.txt
timeout 150 python3 -m pytest -q -m multigpu tests/ops/test_multigpu.py -k training > $out/t_multi.log 2>&1
echo "multigpu training rc=$?"; tail -n 1 $out/t_multi.log
timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py \
  --mode fwdbwd --shape fine --routing sampled --rounds 11 --iters 10 \
  --variant old=wgrad:num_warps=8,pingpong=False > $out/ab_ep2_fine_sampled.log 2>&1
echo "ab ep2 rc=$?"; grep -E "^ +(base|old) " $out/ab_ep2_fine_sampled.log
for r in exact sampled; do
  timeout 240 python3 -m distmoe bench --mode both --shapes issue-a fine issue-b olmoe deepseek-v3 \
    --routing $r --providers distmoe torch --no-plots --out $out/bench_$r > $out/bench_$r.log 2>&1
  echo "bench $r rc=$?"; tail -n 24 $out/bench_$r.log | grep -v "^$"
done
VARIANTS=pp8 timeout 120 python3 docs/perf/2026-11-30-h200-run41/wgrad_bk_micro.py issue-a > $out/micro_issuea.txt 2>&1
echo "micro rc=$?"; grep -v Warn $out/micro_issuea.txt | tail -n 4
tar czf /tmp/g8.tgz -C $out . && cp /tmp/g8.tgz $OUT/
