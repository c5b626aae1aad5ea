# Shared by the one-call GPU check scripts (sourced, from the repository root): the budget
# (first argument, default 560 s), $OUT (default ./out), PYTHONPATH for the tree, `el` (seconds
# since the start), `gpu_tests SECONDS FILE...` (the files' `-m gpu` tests, log in
# $OUT/tests.log, a summary printed) and the GPU's name in $OUT/nvidia-smi.txt.
set -u
BUDGET=${1:-560}
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
gpu_tests() {
  local limit=$1; shift
  echo "== tests $(el)s"
  timeout -k 5 "$limit" python -m pytest -q -m gpu -p no:cacheprovider \
    --timeout $(( limit - 30 )) -rfE "$@" > "$OUT/tests.log" 2>&1
  grep -E "passed|failed|skipped|deselected|no tests ran|FAILED|Error" "$OUT/tests.log" | tail -20
}
nvidia-smi -L | tee "$OUT/nvidia-smi.txt"
