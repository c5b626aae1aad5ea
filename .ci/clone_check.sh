#!/usr/bin/env bash
# CI as it runs elsewhere: `.ci/run` (the README's test command) in a clean clone of the
# committed HEAD, with a fresh .venv, then the demo there.
#
#   bash .ci/clone_check.sh [LOG]   # LOG: where the output goes (default: /tmp/distmoe_ci_clone.log)
#
# The clone lives in a temporary folder that is removed on exit, whatever the outcome: its
# .venv holds torch and triton (about 1.8 GB), and clones left behind by earlier runs once
# filled this machine's disk until pip failed with "No space left on device". ../shared (the
# design documents the tests read) is copied beside the clone when present. Uncommitted
# changes are not in the clone: commit first. Exit status: the suite's, else the demo's.
set -uo pipefail
cd "$(dirname "$0")/.."
log=$(realpath -m "${1:-${TMPDIR:-/tmp}/distmoe_ci_clone.log}")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git clone -q . "$tmp/p" || exit 1
[ -d ../shared ] && cp -r ../shared "$tmp/shared"
echo "clean clone of $(git rev-parse --short HEAD) in $tmp; log: $log"
start=$SECONDS
(cd "$tmp/p" && CI=true bash .ci/run) > "$log" 2>&1
rc=$?
echo "suite: rc=$rc, $((SECONDS - start)) s: $(grep -E '[0-9]+ (passed|failed)' "$log" | tail -1)"
if [ "$rc" -eq 0 ]; then
  (cd "$tmp/p" && ./run demo) >> "$log" 2>&1
  rc=$?
  echo "demo: rc=$rc: $(grep -E 'PASS|FAIL' "$log" | tail -1)"
fi
exit "$rc"
