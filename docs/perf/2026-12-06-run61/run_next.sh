#!/usr/bin/env bash
# For a session that gets an H200 (`DEADLINE=590 bash ...`, about 3 minutes): call 8's
# script (run_c8.sh: the layer against every expert-group order off at DeepSeek-V3 and fine,
# the W2 forward's order at 96 rows per expert, the fwd+bwd bench), the orders' first
# reading on an H200. On any other GPU it says so and stops (run 61 read it on an H100).
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case $name in
  *H200*) exec bash "$(dirname "$0")/run_c8.sh" ;;
  *) echo "not an H200 ($name): run 61 call 8 read this script on an H100; nothing run" ;;
esac
