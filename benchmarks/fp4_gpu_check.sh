#!/usr/bin/env bash
# The FP4-weight (NVFP4 / MXFP4) work that waits for a GPU, in one call on the GPU machine,
# from the repository root (each step bounded; logs to $OUT, default ./out):
#
#   bash benchmarks/fp4_gpu_check.sh [BUDGET_S]
#
# With OLD_SRC_TAR set to a tarball of an older tree's src/ (git archive -o FILE REV src;
# carry it), step 3 also runs the NVFP4 decode cases on that tree first, in the same call,
# for a ratio on one machine.
#
# 1. the GPU tests of the FP4 GEMMs (all three tile forms), the one-axis quantiser grids and
#    the NVFP4 layer (incl. two ranks sharing the GPU);
# 2. the FP4 GEMM configs at decode (8 rows, K = N = 4096) and prefill (qwen3-30b-a3b's W13):
#    bf16 operands, the transposed tile (swap_ab), FP8 operands, against torch._grouped_mm;
# 3. the NVFP4 layer at decode beside bf16 (issue 59: 2.5x faster at T <= 32, 70% of copy);
# 4. the NVFP4 layer at prefill with FP8 operands against its plan (ab, interleaved).
# Run 76 set fp4_swap_rows and fp4_fp8_min_rows (plan/thresholds.py) and kept
# ScaledGemmConfig.interleave_k on from these numbers; rerun it after a change to the FP4
# GEMMs (the sweep's <variant>_split rows time the split-K form).
source benchmarks/gpu_check_lib.sh
gpu_tests 180 tests/kernels/scaled/test_nvfp4_weight_mm.py \
  tests/kernels/scaled/test_nvfp4_fp8_mm.py tests/quant/test_wide_grids.py \
  tests/ops/test_nvfp4_forward.py
echo "== FP4 GEMM configs $(el)s"
for spec in "--rows 8 --k 4096 --n 4096" "--rows 32768 --experts 128 --k 2048 --n 1536"; do
  name=$(echo "$spec" | tr -d ' -')
  timeout -k 5 90 python benchmarks/scaled_mm.py $spec --variants nvfp4_bf16 nvfp4_fp8 \
    --sweep --json "$OUT/fp4_$name.json" 2>&1 | grep -v "^ *$" | tail -30
done
echo "== layer decode, nvfp4 then bf16 $(el)s"
if [ -n "${OLD_SRC_TAR:-}" ] && [ -f "$OLD_SRC_TAR" ]; then
  OLD=$(mktemp -d) && tar -xf "$OLD_SRC_TAR" -C "$OLD"
  echo "-- nvfp4 on the old tree ($OLD_SRC_TAR)"
  PYTHONPATH="$OLD/src" timeout -k 5 60 python -m distmoe bench --providers distmoe \
    --precision nvfp4 --mode fwd --tokens 1 8 32 --shapes dense-e32 deepseek-v3 \
    --timing graph --no-plots --out "$OUT/layer-nvfp4-old" 2>&1 \
    | grep "distmoe \|ceiling\|Error" | tail -14
fi
for p in nvfp4 bf16; do
  timeout -k 5 60 python -m distmoe bench --providers distmoe --precision $p --mode fwd \
    --tokens 1 8 32 --shapes dense-e32 deepseek-v3 --timing graph --no-plots \
    --out "$OUT/layer-$p" 2>&1 | grep "distmoe \|ceiling\|Error" | tail -14
done
echo "== layer prefill, FP8 operands against the plan $(el)s"
timeout -k 5 $(( BUDGET - $(el) )) python -m distmoe ab --shape qwen3-30b-a3b --mode fwd \
  --precision nvfp4 --variant fp8=layer:fp8_operands=True --rounds 5 2>&1 | tail -6
echo "== done $(el)s"
