#!/usr/bin/env bash
# run 43, call 5 (one H200): with the split W2 DGRAD as the pick, the fwd+bwd bench under
# sampled routing (the README table's column), then issue-a exact again with more rounds
# (call 4's 7 rounds read the two kernels even there).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o5; mkdir -p $out
t0=$SECONDS
timeout 100 python3 -m distmoe bench --mode fwdbwd --shapes issue-a fine issue-b olmoe deepseek-v3 \
  --routing sampled --providers distmoe torch --no-plots --out $out/bench_sampled > $out/bench_sampled.log 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"; grep -E "^(distmoe|torch) " $out/bench_sampled.log | cut -c1-100
timeout 70 python3 tools/ab_interleaved.py --mode fwdbwd --iters 10 --shape issue-a --routing exact \
  --rounds 13 --variant pp=w2_dgrad:epilogue_warps=0 > $out/ab_issue-a_exact.log 2>&1
echo "ab rc=$? at $((SECONDS - t0)) s"; grep -E "^ +(base|pp) " $out/ab_issue-a_exact.log
tar czf /tmp/g5.tgz -C $out . && cp /tmp/g5.tgz $OUT/
