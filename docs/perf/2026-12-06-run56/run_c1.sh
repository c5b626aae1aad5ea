#!/usr/bin/env bash
# run 56 call 1: run 55's follow-up script as written (the WGRAD lockstep pick, DeepSeek-V3's
# W13 WGRAD, 56 MiB an expert: its GPU tests, the layer with the pick against without under
# both routings, then the bench after the pick). Ran as `DEADLINE=540 bash run_c1.sh`.
exec bash "$(dirname "$0")/../2026-12-05-run55/run_c10.sh" "$@"
