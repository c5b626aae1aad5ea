#!/usr/bin/env bash
# run 57, call 2: is the W13 forward bound by the bytes its ring keeps in flight? Call 1 saw
# its producer waiting for a free stage 78% of its time while both consumers waited for data
# 82%: every stage in flight. Run 56's call 10 read two K steps a stage (2 stages, the same
# 192 KiB) 11% slower in the inference forward. Here the cooperative tile's 4 stages against
# 3 (x > 1 on s3's line: 3 faster). On an H200 (room for a second DeepSeek-V3 layer), also
# the W13 WGRAD reading x's rows in place there against the saved rows. Set DEADLINE (s).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
D=${DEADLINE:-400}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
ab() {  # shape mode routing tag args...
  shape=$1 mode=$2 routing=$3 tag=$4; shift 4
  left=$((D - (SECONDS - t0))); [ $left -lt 40 ] && return
  timeout $left python3 tools/ab_interleaved.py --shape $shape --mode $mode --routing $routing \
    --rounds 9 "$@" > $OUT/ab_${shape}_${mode}_${routing}_$tag.log 2>&1
  echo "ab $shape $mode $routing $tag rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(|regathered" $OUT/ab_${shape}_${mode}_${routing}_$tag.log | head -3
}
ab deepseek-v3 fwd sampled s3 --variant s3=w13:inference:num_stages=3
ab deepseek-v3 fwdbwd exact s3 --variant s3=w13:training:num_stages=3
ab issue-a fwd exact s3 --variant s3=w13:inference:num_stages=3
if [[ $name == *H200* ]]; then
  ab deepseek-v3 fwdbwd sampled inplace --regather --regather-in-place on
  ab deepseek-v3 fwdbwd exact inplace --regather --regather-in-place on
fi
