#!/usr/bin/env bash
# run 52, call 6 (one H100): W2Config.lockstep (the W2 forward's producers in lockstep, as the
# W13's): its GPU tests, the layer test at 128 rows per expert (W13 lockstep by the
# heuristic), then the W2 option at the layer, interleaved, sampled routing: deepseek-v3 and
# gpt-oss-120b (128 rows per expert) forward, gpt-oss-120b fwd+bwd, issue-b and fine forward
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_forward_kernels.py \
  tests/ops/test_training_gpu.py -k "w2_gluon or partial_column" > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"; tail -n 1 $OUT/pytest.log; grep -E "^FAILED|^ERROR" $OUT/pytest.log | head -8
for spec in "deepseek-v3 fwd" "gpt-oss-120b fwd" "gpt-oss-120b fwdbwd" "issue-b fwd" "fine fwd"; do
  set -- $spec
  left=$((330 - (SECONDS - t0))); [ $left -lt 40 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode $2 --routing sampled \
    --rounds 9 --variant w2ls=w2:lockstep=True > $OUT/ab_$1_$2.log 2>&1
  echo "ab $* rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_$2.log | head -2
done
