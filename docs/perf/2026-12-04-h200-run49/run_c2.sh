#!/usr/bin/env bash
# run 49, call 2 (one H200): the Gluon W2 forward, W13 DGRAD and WGRAD where 128 does not
# divide D (GPT-OSS: D = F = 2880). GPU tests of the three kernels (partial tiles included)
# and of a training layer at D = 320 on them; then the layer at gpt-oss-120b / -20b with
# each kernel back on its Triton pick (interleaved A/B), and the bench against torch.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
timeout 300 python3 -m pytest -q -p no:cacheprovider -x \
  tests/kernels/test_backward_kernels.py -k "gluon_wgrad or gluon_w13_dgrad" > $OUT/pytest_bwd.log 2>&1
echo "pytest bwd rc=$? at $((SECONDS - t0)) s"; tail -n 3 $OUT/pytest_bwd.log; grep -E "^FAILED|Error" $OUT/pytest_bwd.log | head -5
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_forward_kernels.py -k "gpu_w2_gluon" \
  "tests/ops/test_training_gpu.py::test_training_gpu_gluon_kernels_with_partial_column_tiles" \
  > $OUT/pytest_fwd.log 2>&1
echo "pytest fwd+layer rc=$? at $((SECONDS - t0)) s"; tail -n 3 $OUT/pytest_fwd.log; grep -E "^FAILED|Error" $OUT/pytest_fwd.log | head -5
W2TRI="w2:gluon=False,block_n=256,num_warps=8,num_stages=4"
WGTRI="w2_wgrad:gluon=False,specialized=False,pingpong=False,num_warps=8,num_stages=3"
W13DTRI="w13_dgrad:gluon=False,block_n=256,num_warps=8,num_stages=4,pair_tails=True,dynamic=True"
for shape in gpt-oss-120b gpt-oss-20b; do
  left=$((470 - (SECONDS - t0))); [ $left -lt 60 ] && break
  extra=(); [ $shape = gpt-oss-20b ] && extra=(--variant "w13dtri=$W13DTRI" --variant "alltri=$W2TRI+$WGTRI+$W13DTRI")
  [ $shape = gpt-oss-120b ] && extra=(--variant "alltri=$W2TRI+$WGTRI")
  timeout $left python3 tools/ab_interleaved.py --shape $shape --mode fwdbwd --rounds 7 \
    --variant "w2tri=$W2TRI" --variant "wgtri=$WGTRI" "${extra[@]}" > $OUT/ab_$shape.log 2>&1
  echo "ab $shape rc=$? at $((SECONDS - t0)) s"; tail -n 8 $OUT/ab_$shape.log
done
left=$((580 - (SECONDS - t0)))
if [ $left -gt 60 ]; then
  timeout $left python3 -m distmoe bench --shapes gpt-oss-120b gpt-oss-20b --mode both --routing sampled \
    --providers distmoe torch --no-plots --out $OUT/bench > $OUT/bench.log 2>&1
  echo "bench rc=$? at $((SECONDS - t0)) s"; grep -E "^(distmoe|torch) " $OUT/bench.log
fi
