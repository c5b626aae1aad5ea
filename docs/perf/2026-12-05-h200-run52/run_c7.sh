#!/usr/bin/env bash
# run 52, call 7: the heuristics as committed (W13 and W2 lockstep at 128-191 rows per
# expert, the W2's where an expert's W2 weights hold >= 8 MiB) against both off; the layer
# GPU test at 128 rows per expert (W13 lockstep by the heuristic) that call 6 ran out of
# time for; on an H200 (>= 100 GB) also deepseek-v3's layer fwd+bwd
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
specs=("deepseek-v3 fwd" "gpt-oss-120b fwdbwd")
[ "$mem" -ge 100000 ] && specs=("deepseek-v3 fwdbwd" "${specs[@]}")
for spec in "${specs[@]}"; do
  set -- $spec
  left=$((230 - (SECONDS - t0))); [ $left -lt 40 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode $2 --routing sampled \
    --rounds 7 --variant off=w13:lockstep=False+w2:lockstep=False > $OUT/ab_$1_$2.log 2>&1
  echo "ab $* rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_$2.log | head -2
  grep -E "lockstep" $OUT/ab_$1_$2.log | grep -oE "_w(13|2)_cfg.*lockstep=[A-Za-z]+" | sed -E 's/\(.*lockstep/ lockstep/' | head -4
done
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_training_gpu.py \
  -k "partial_column" > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"; tail -n 1 $OUT/pytest.log; grep -E "^FAILED|^ERROR" $OUT/pytest.log | head -8
