#!/usr/bin/env bash
# run 57, call 6: the WGRAD's device-keyed rule (an H200 takes the 256 x 128 tiles from 1024
# rows per expert only; ping-pong below). Its tests (the rules; the 256-row-tile training
# test, now at 1024 rows per expert, EP=1 and 2), then on an H200 the layer with the rule
# against the old pick ("wide": 256 x 128 tiles, the W13 WGRAD's in lockstep; x < 1 on its
# line: the rule faster). Set DEADLINE (s).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
D=${DEADLINE:-300}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -n 3 -rfE \
  tests/kernels/test_backward_kernels.py::test_gluon_wgrad_config_rules \
  tests/ops/test_training_gpu.py::test_training_gpu_wgrad_256_row_tiles > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 3 $OUT/tests.log
w=block_out_m=256,num_warps=8,num_stages=3,pingpong=False
for a in "deepseek-v3 exact True" "gpt-oss-20b sampled False" "gpt-oss-120b sampled False"; do
  set -- $a  # shape routing, and whether the old pick ran the W13 WGRAD in lockstep (>= 48 MiB)
  old="w13_wgrad:$w,lockstep=$3+w2_wgrad:$w,lockstep=False"
  left=$((D - (SECONDS - t0))); [ $left -lt 40 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 \
    --rounds 11 --variant wide=$old > $OUT/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(|_wgrad_cfg" $OUT/ab_$1_$2.log | cut -c1-160 | head -6
done
