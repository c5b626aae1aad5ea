#!/usr/bin/env bash
# run 52, call 1 (one H100; no H200 came): the lockstep W13 GPU tests again (their helper was
# refactored after run 51's GPU run), then W13Config.lockstep at the layer (fwd+bwd) at the
# shapes that fit 80 GB with about 96-128 rows per expert: deepseek-v4-flash (96 rows) and
# gpt-oss-120b (128 rows)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_forward_kernels.py -m gpu -k "lockstep or test_gpu_w13_gluon_heuristic" \
  > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"; tail -n 2 $OUT/pytest.log; grep -E "^FAILED|^ERROR" $OUT/pytest.log | head -8
for spec in "deepseek-v4-flash sampled" "gpt-oss-120b sampled" "deepseek-v4-flash exact"; do
  set -- $spec
  left=$((540 - (SECONDS - t0))); [ $left -lt 40 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 \
    --rounds 7 --variant ls=w13:lockstep=True > $OUT/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_$2.log | head -2; tail -n 1 $OUT/ab_$1_$2.log | cut -c1-160
done
