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
