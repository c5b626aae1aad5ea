#!/usr/bin/env bash
# run 54, call 1 (one H200, 2026-12-05, thirty-eighth session): run 53's call 5, which never
# ran: deepseek-v3's fwd+bwd layer, the heuristic (W13 forward, W2 forward and W2 DGRAD
# producers in lockstep) against the W2 DGRAD's lockstep off and against all three off,
# interleaved, sampled routing first
set -u
ROUTINGS=${ROUTINGS:-sampled} BUDGET=${BUDGET:-540} \
  bash docs/perf/2026-12-05-h200-run53/run_c5.sh
