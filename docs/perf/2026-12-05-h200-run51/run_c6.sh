#!/usr/bin/env bash
# run 51, call 6: W13Config.lockstep (call 5: the training W13 alone at deepseek-v3 under
# random routing 6.64 ms against 8.81, 1.33x; 1.1% slower under exact routing), its GPU tests,
# then at the layer (fwd+bwd, sampled routing) at the shapes that fit an H100
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_forward_kernels.py -m gpu \
  -k "lockstep or test_gpu_w13_gluon_heuristic" > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"; tail -n 2 $OUT/pytest.log; grep -E "^FAILED|^ERROR" $OUT/pytest.log | head -8
for shape in fine olmoe issue-b issue-a; do
  left=$((330 - (SECONDS - t0))); [ $left -lt 40 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $shape --mode fwdbwd --routing sampled \
    --rounds 7 --variant ls=w13:lockstep=True > $OUT/ab_$shape.log 2>&1
  echo "ab $shape rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$shape.log; tail -n 1 $OUT/ab_$shape.log | cut -c1-160
done
