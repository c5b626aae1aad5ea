#!/usr/bin/env bash
# call 4 (one H200), main code: the Gluon WGRAD's GPU tests with the new 48-row expert; the
# bench at olmoe, issue-b and deepseek-v3 under exact and sampled routing; the decode A/B at
# deepseek-v3 that run 30 could not finish (cooperative Gluon W13 against the Triton W13).
set -u
out=/tmp/o4; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_backward_kernels.py -k gluon_wgrad \
  > $out/t_wgrad.log 2>&1; echo "wgrad tests rc=$?"; tail -n 1 $out/t_wgrad.log
for r in exact sampled; do
  timeout 170 python3 -m distmoe bench --mode both --shapes olmoe issue-b deepseek-v3 \
    --routing $r --providers distmoe torch --no-plots --no-ceilings --out $out/bench_$r \
    > $out/bench_$r.log 2>&1
  echo "bench $r rc=$?"; grep -E "^(distmoe|torch) " $out/bench_$r.log
done
for t in 16 128; do
  timeout 150 python3 tools/ab_interleaved.py --mode fwd --shape deepseek-v3 --tokens $t \
    --rounds 11 --iters 20 --variant tri=w13:inference:gluon=False > $out/ab_v3_T$t.log 2>&1
  echo "ab deepseek-v3 T=$t rc=$?"; grep -v "^\*\|OMP" $out/ab_v3_T$t.log | tail -n 4
done
tar czf /tmp/g4.tgz -C $out . && cp /tmp/g4.tgz $OUT/
