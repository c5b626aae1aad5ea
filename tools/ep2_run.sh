#!/usr/bin/env bash
# Issue 7 targets 5 and 6 on nvidia-h200-x2, in one device call:
#   EP=2 over NVLink (torchrun, one rank per GPU, imbalance 1 and 2) and the same per-rank
#   work at EP=1 (--rank-share-of 2), forward and forward+backward: about 3 minutes;
#   then target 5's ratio from one process: tools/ab_interleaved.py --ep1-share, EP=2 and the
#   EP=1 share replayed in the same rounds (the sequential figures drift by a few per cent
#   with the clock, performance.md run 29): about 2 minutes;
#   with "full", also the EP=1 suite of the four default shapes: about 3 more.
# Usage: bash tools/ep2_run.sh GIT_SHA [full]   (tar.gz archives and logs go to $OUT)
set -u
sha=${1:-unknown}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
common=(--git-sha "$sha" --providers distmoe torch)
# --activation-factor 2: the slot holds the loaded rank's state at imbalance 2, so those layers
# save instead of replaying in backward (run 17, without it: 1.25x the balanced time per row)
timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node=2 -m distmoe bench \
    --mode both --shapes issue-a fine --imbalance 1 2 --activation-factor 2 "${common[@]}" \
    --out "$out/ep2" --archive "$out/ep2.tar.gz" > "$out/ep2.log" 2>&1
echo "ep2 rc=$?"; grep -A22 "^provider" "$out/ep2.log"; tail -3 "$out/ep2.log"
timeout 120 python3 -m distmoe bench --mode both --shapes issue-a fine --rank-share-of 2 \
    "${common[@]}" --no-plots --out "$out/ep1share" --archive "$out/ep1share.tar.gz" \
    > "$out/ep1share.log" 2>&1
echo "ep1share rc=$?"; grep -A12 "^provider" "$out/ep1share.log"
for spec in "fine 21" "issue-a 11"; do
    read -r shape rounds <<< "$spec"
    timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
        tools/ab_interleaved.py --ep1-share --shape "$shape" --mode fwd --rounds "$rounds" \
        > "$out/interleaved_$shape.log" 2>&1
    echo "interleaved $shape rc=$?"; tail -3 "$out/interleaved_$shape.log"
done
if [ "${2:-}" = full ]; then
    timeout 180 python3 -m distmoe bench --mode both --git-sha "$sha" --no-plots \
        --out "$out/ep1" --archive "$out/ep1.tar.gz" > "$out/ep1.log" 2>&1
    echo "ep1 rc=$?"; grep -A30 "^provider" "$out/ep1.log"
fi
rm -rf "$out/ep2" "$out/ep1share" "$out/ep1"
