# run 58's layer A/B helper, sourced by run_c5.sh and run_c6.sh (needs OUT): sets the
# environment, t0 and the deadline D (DEADLINE, default 540 s), prints the GPU, and defines
# ab SHAPE[@TOKENS] MODE ROUTING
# ROUNDS VARIANT... runs tools/ab_interleaved.py within the deadline (TOKENS: --tokens) and
# prints its variant lines (logs named ab_SHAPE[_tTOKENS]_MODE_ROUTING.log; call 6 named them
# with the @, and its three such logs did not come back: their figures are in performance.md
# run 58 section 3).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
D=${DEADLINE:-540}
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm --format=csv,noheader
ab() {
  local shape=${1%@*} tag=$1 mode=$2 routing=$3 rounds=$4; shift 4
  local left=$((D - (SECONDS - t0))); [ $left -lt 40 ] && return
  local args=(); for v in "$@"; do args+=(--variant "$v"); done
  [[ $tag == *@* ]] && args+=(--tokens "${tag#*@}")
  timeout $left python3 tools/ab_interleaved.py --shape $shape --mode $mode --routing $routing \
    --rounds $rounds "${args[@]}" > $OUT/ab_${tag/@/_t}_${mode}_${routing}.log 2>&1
  echo "ab $tag $mode $routing rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_${tag/@/_t}_${mode}_${routing}.log | head -3
}
ncu_eg() {
  local regex=$1 tag=$2 mode=$3 routing=$4 spec=$5 eg log
  for eg in False True; do
    [ $((SECONDS - t0)) -gt $((D - 40)) ] && return
    log=$OUT/ncu_${spec%%:*}_${tag/@/_t}_${mode}_eg$eg.log
    timeout 100 ncu --clock-control none -k regex:$regex --launch-skip 2 --launch-count 1 \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum \
      python3 "$(dirname "${BASH_SOURCE[0]}")/ncu_layer_variant.py" $tag $mode $routing \
      $spec:expert_groups=$eg > $log 2>&1
    echo "ncu $regex $tag $mode eg=$eg rc=$?"
    grep -E "^  [_a-z]|gpu__time|dram__" $log | sed -E 's/ +/ /g' | cut -c1-70
  done
}
