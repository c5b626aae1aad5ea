#!/usr/bin/env bash
# Issue 7 target 5/6 on nvidia-h200-x2, in one device call (about 6-8 minutes):
#   EP=2 over NVLink (torchrun, one rank per GPU), the same per-rank work at EP=1
#   (--rank-share-of 2), and the EP=1 suite of the four default shapes.
# Usage: bash tools/ep2_run.sh GIT_SHA   (writes tar.gz archives and logs to $OUT)
set -u
sha=${1:-unknown}
out=${OUT:-out}
export PYTHONPATH=src PYTHONUNBUFFERED=1
common=(--git-sha "$sha" --providers distmoe torch)
timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node=2 -m distmoe bench \
    --mode both --shapes issue-a fine --imbalance 1 2 "${common[@]}" \
    --out "$out/ep2" --archive "$out/ep2.tar.gz" > "$out/ep2.log" 2>&1
echo "ep2 rc=$?"; tail -30 "$out/ep2.log"
timeout 120 python3 -m distmoe bench --mode both --shapes issue-a fine --rank-share-of 2 \
    "${common[@]}" --no-plots --out "$out/ep1share" --archive "$out/ep1share.tar.gz" \
    > "$out/ep1share.log" 2>&1
echo "ep1share rc=$?"; tail -16 "$out/ep1share.log"
timeout 180 python3 -m distmoe bench --mode both --git-sha "$sha" --no-plots \
    --out "$out/ep1" --archive "$out/ep1.tar.gz" > "$out/ep1.log" 2>&1
echo "ep1 rc=$?"; tail -30 "$out/ep1.log"
rm -rf "$out/ep2" "$out/ep1share" "$out/ep1"
