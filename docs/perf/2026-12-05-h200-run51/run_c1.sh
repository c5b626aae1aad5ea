#!/usr/bin/env bash
# run 51, call 1 (one GPU): the two GPU tests written after run 50 (the Gluon kernels with
# partial column tiles at EP=2 on one GPU through the IPC heap; the receive-bound overflow
# and check mode's collective raise on a GPU), then the ping-pong W13 training forward at
# deepseek-v3 against the cooperative pick at the layer (run 50 call 2: 3% faster alone)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/ops/test_training_gpu.py \
  tests/ops/test_context_errors.py -m gpu -k "partial_column or overflow" \
  > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"; tail -n 2 $OUT/pytest.log; grep -E "^FAILED|^ERROR|Error" $OUT/pytest.log | head -8
for r in sampled exact; do
  left=$((560 - (SECONDS - t0))); [ $left -lt 60 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape deepseek-v3 --mode fwdbwd --routing $r \
    --rounds 7 --variant w13pp=w13:training:num_warps=4,num_stages=5 > $OUT/ab_w13pp_$r.log 2>&1
  echo "ab $r rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_w13pp_$r.log; tail -n 2 $OUT/ab_w13pp_$r.log | cut -c1-160
done
