#!/usr/bin/env bash
# run 49, call 5 (one H200): the GPU tests this run's kernels reach but calls 2-3 did not
# run (the training and forward layer tests, the fused W13 + W2 kernel, the W2 DGRAD's h1
# prefetch); then two picks the size bounds keep on Triton at gpt-oss-120b (4.25 GB of W13
# weights): the Gluon W13 DGRAD in training and the cooperative W13 at 64 rows per expert.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/ops/test_training_gpu.py \
  tests/ops/test_forward_gpu.py tests/kernels/test_forward_kernels.py \
  tests/kernels/test_backward_kernels.py -m gpu -k "training_gpu or forward_gpu or input_buffer or cuda_graph or fused or h1_prefetch" \
  > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"; tail -n 2 $OUT/pytest.log; grep -E "^FAILED|^ERROR" $OUT/pytest.log | head -5
W13DG="w13_dgrad:gluon=True,block_n=128,num_warps=4,num_stages=5,pair_tails=False,dynamic=False"
W13G="w13:inference:gluon=True"
for spec in "fwdbwd 4096 w13dg=$W13DG" "fwd 2048 w13g=$W13G"; do
  set -- $spec
  left=$((450 - (SECONDS - t0))); [ $left -lt 40 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape gpt-oss-120b --mode $1 --tokens $2 \
    --rounds 9 --variant "$3" > $OUT/ab_$1_T$2.log 2>&1
  echo "ab $1 T=$2 rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_T$2.log
done
