#!/usr/bin/env bash
# call 9 (one H200): at issue-a (2048 rows per expert) the heuristic's plain 128 x 256 WGRAD
# against the warp-specialised 128 x 128 tile with 8 cooperating warps (4-7% faster alone in
# call 8), layer fwd+bwd both routings; deepseek-v3 exact, the ping-pong pick against the
# old cooperative one (call 7 measured it sampled only).
set -u
out=/tmp/o9; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/status.txt
for spec in "issue-a exact 7" "issue-a sampled 7"; do
  set -- $spec
  timeout 150 python3 tools/ab_interleaved.py --mode fwdbwd --shape $1 --routing $2 --rounds $3 \
    --iters 10 --variant ws8=wgrad:block_out_n=128,num_stages=5,specialized=True > $out/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$?"; grep -E "^ +(base|ws8) " $out/ab_$1_$2.log
done
timeout 150 python3 tools/ab_interleaved.py --mode fwdbwd --shape deepseek-v3 --routing exact --rounds 5 \
  --iters 10 --variant old=wgrad:num_warps=8,pingpong=False > $out/ab_deepseek-v3_exact.log 2>&1
echo "ab deepseek-v3 exact rc=$?"; grep -E "^ +(base|old) " $out/ab_deepseek-v3_exact.log
tar czf /tmp/g9.tgz -C $out . && cp /tmp/g9.tgz $OUT/
