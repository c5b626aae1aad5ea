#!/usr/bin/env bash
# The work that waits for a GPU (beside fp4_gpu_check.sh), in one call on the GPU machine,
# from the repository root (each step bounded; logs to $OUT, default ./out):
#
#   bash benchmarks/pending_gpu_check.sh [BUDGET_S]
#
# 1. GPU tests rewritten or added since they last passed on a GPU: the bf16 training graphs
#    with TrainingGraphs.whole_backward (one graph of the whole backward, bits against
#    graphs=False) (-m gpu only);
# 2. issue 66's host time per eager fwd+bwd (target 0.5 ms): the context's three-part
#    backward graphs (`distmoe`) against whole_backward (`distmoe-wb`), qwen3-30b-a3b and
#    decode T=64; keep whole_backward on where its host time is lower and its wall time
#    not higher;
# 3. issue 65's packing target (shared budget >= 1.2x per-layer budgets at 8x imbalance):
#    the seed suite's packing workload, never run on a GPU.
# Every step runs even after a failure; each step gets what the ones before leave.
source benchmarks/gpu_check_lib.sh
gpu_tests 240 tests/ops/test_training_graphs_gpu.py
echo "== eager host, three-part against whole backward graphs $(el)s"
timeout -k 5 150 python benchmarks/eager_host.py --shapes qwen3-30b-a3b decode-dense-e32 \
  --modes fwdbwd --calls 20 --rounds 3 --out "$OUT/eager" 2>&1 | grep -v "^ *$" | tail -14
echo "== seed suite, packing at 8x imbalance $(el)s"
timeout -k 5 $(( BUDGET - $(el) )) python -m distmoe bench --suite seed --seed-cases packing \
  --imbalance 8 --routing exact --no-plots --out "$OUT/seed" 2>&1 \
  | grep -v "^ *$" | grep -v "bench: " | tail -20
echo "== done $(el)s"
