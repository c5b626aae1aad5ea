#!/usr/bin/env bash
# run 49, call 3 (one H200): the Gluon W13 forward (cooperative tile) and split W2 DGRAD
# where 128 does not divide F (GPT-OSS: F = 2880). GPU tests of both kernels (partial tiles
# included; the W13 and W2 DGRAD suites again) and of a training layer at D = 320, F = 1088
# on every Gluon kernel; then gpt-oss-120b / -20b with each kernel on its old pick
# (interleaved A/B, fwd+bwd and forward), and the bench against torch.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
timeout 240 python3 -m pytest -q -p no:cacheprovider -x \
  tests/kernels/test_forward_kernels.py -k "gpu_w13_gluon" \
  tests/kernels/test_backward_kernels.py::test_gluon_w2_dgrad_partial_column_tile \
  tests/kernels/test_backward_kernels.py::test_gluon_w2_dgrad_heuristic \
  tests/kernels/test_backward_kernels.py::test_gluon_w2_dgrad \
  tests/kernels/test_backward_kernels.py::test_gluon_w2_dgrad_scored \
  tests/kernels/test_backward_kernels.py::test_gluon_w2_dgrad_split_epilogue \
  "tests/ops/test_training_gpu.py::test_training_gpu_gluon_kernels_with_partial_column_tiles" \
  > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"; tail -n 3 $OUT/pytest.log; grep -E "^FAILED|Error" $OUT/pytest.log | head -5
W13PP="w13:training:block_n=64,num_warps=4,num_stages=6"
W2DTRI="w2_dgrad:gluon=False,epilogue_warps=0,num_warps=8,num_stages=4"
W13TRI="w13:inference:gluon=False"
for spec in "gpt-oss-120b fwdbwd" "gpt-oss-20b fwdbwd" "gpt-oss-120b fwd"; do
  set -- $spec
  left=$((450 - (SECONDS - t0))); [ $left -lt 50 ] && break
  if [ $2 = fwd ]; then v=(--variant "w13tri=$W13TRI"); else
    v=(--variant "w13pp=$W13PP" --variant "w2dtri=$W2DTRI" --variant "both=$W13PP+$W2DTRI"); fi
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode $2 --rounds 7 "${v[@]}" \
    > $OUT/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_$2.log
done
left=$((585 - (SECONDS - t0)))
if [ $left -gt 60 ]; then
  timeout $left python3 -m distmoe bench --shapes gpt-oss-120b gpt-oss-20b --mode both --routing sampled \
    --providers distmoe torch --no-plots --out $OUT/bench > $OUT/bench.log 2>&1
  echo "bench rc=$? at $((SECONDS - t0)) s"; grep -E "^(distmoe|torch) " $OUT/bench.log
fi
