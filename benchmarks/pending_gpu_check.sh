#!/usr/bin/env bash
# The bf16 work that waits for a GPU beside the FP4 check (fp4_gpu_check.sh), in one call on
# the GPU machine, from the repository root (each step bounded; logs to $OUT, default ./out):
#
#   bash benchmarks/pending_gpu_check.sh [BUDGET_S]
#
# 1. GPU tests rewritten or added since they last passed on a GPU: the bf16 training graphs
#    (the .grad-address check rewritten after run 74), the VMM tiered range (free memory now
#    read without torch's cache), device-selected slots in one CUDA graph, the host-backed
#    (VMM) inference scratch with two ranks on the GPU (-m gpu only);
# 2. issue 66's figures at every suite shape: the bench with eager and graph timing side by
#    side and the host time per call, distmoe against the torch baseline, sampled routing;
# 3. issue 66's decode case (T = 64 at dense-e32, forward): eager against graph replay and
#    the share of the copy rate (the bench's HBM column against its ceilings).
# Every step runs even after a failure; step 2 gets what step 1 leaves, less step 3's share.
source benchmarks/gpu_check_lib.sh
gpu_tests 200 tests/ops/test_training_graphs_gpu.py tests/runtime/test_vmm.py \
  tests/ops/test_slot_selection_gpu.py tests/ops/test_host_tier.py
echo "== suite shapes, eager and graph, distmoe and torch $(el)s"
timeout -k 5 $(( BUDGET - $(el) - 90 )) python -m distmoe bench --providers distmoe torch \
  --routing sampled --timing both --mode both --no-plots --out "$OUT/suite" 2>&1 \
  | grep -v "^ *$" | tail -40
echo "== decode T=64 dense-e32 fwd, eager and graph $(el)s"
timeout -k 5 $(( BUDGET - $(el) )) python -m distmoe bench --providers distmoe torch \
  --routing sampled --timing both --mode fwd --tokens 64 --shapes dense-e32 --no-plots \
  --out "$OUT/decode" 2>&1 | grep -v "^ *$" | tail -20
echo "== done $(el)s"
