#!/usr/bin/env bash
# Layer A/B of two source trees in one device call, alternating A B A B ... so that clock
# drift hits both alike (compare within one call only).
# Usage: bash tools/ab_layer.sh BASE_SRC ROUNDS BENCH_ARGS...
#   BASE_SRC: the A tree's src directory (e.g. from `git archive BASE src | tar -x -C ab_base`,
#   carried to the device); B is this checkout's src. Each run is
#   `python3 -m distmoe bench BENCH_ARGS --no-plots`; its table and the run's exit code go to
#   $OUT/ab.log (one file: the device returns few files), the bench directories are removed.
set -u
usage="usage: bash tools/ab_layer.sh BASE_SRC ROUNDS BENCH_ARGS..."
if [ $# -lt 2 ]; then echo "$usage" >&2; exit 2; fi
base=$1; rounds=$2; shift 2
if [ ! -f "$base/distmoe/__init__.py" ]; then
    # else PYTHONPATH would name nothing and the A side would import this checkout's distmoe
    echo "ab_layer.sh: error: BASE_SRC ($base) holds no distmoe package ($base/distmoe)" >&2
    exit 2
fi
case "$rounds" in
    ''|*[!0-9]*|0) echo "ab_layer.sh: error: ROUNDS ($rounds) must be a positive integer" >&2
                   exit 2 ;;
esac
out=${OUT:-out}
mkdir -p "$out"
log="$out/ab.log"
: > "$log"  # this call's rounds only
for i in $(seq 1 "$rounds"); do
    for side in A B; do
        src=src; [ "$side" = A ] && src=$base
        dir="$out/ab_${side}${i}"
        PYTHONPATH=$src PYTHONUNBUFFERED=1 timeout 300 python3 -m distmoe bench "$@" \
            --no-plots --out "$dir" > "$dir.log" 2>&1
        rc=$?
        { echo "=== $side round $i (PYTHONPATH=$src) rc=$rc: bench $*"
          grep -A16 "^provider" "$dir.log" || tail -20 "$dir.log"; } >> "$log"
        rm -rf "$dir" "$dir.log"
    done
done
cat "$log"
