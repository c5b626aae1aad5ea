#!/usr/bin/env bash
# Same bits and no slowdown against the pre-restructure tree, then the GPU tests, on the GPU
# machine, from the repository root:
#
#   git archive -o .baseline/old_src.tar pre-restructure-57 src      # here, once
#   bash benchmarks/gpu_verify.sh [OLD_SRC_TAR] [BUDGET_S] [AB_BUDGET_S]
#
# OLD_SRC_TAR: tarball of the old tree's src/ (default .baseline/old_src.tar).
# BUDGET_S: seconds for everything (default 570); the A/B script may start cases until
# AB_BUDGET_S (default 60% of BUDGET_S), pytest gets what is left. Logs go to $OUT (default
# ./out): nvidia-smi.txt, same_bits.log, same_bits/{same_bits.json,same_bits.txt}, pytest.log.
# Every step runs even after a failure; the exit code is 0 only if every step passed.
set -uo pipefail

TAR=${1:-.baseline/old_src.tar}
BUDGET=${2:-570}
AB_BUDGET=${3:-$((BUDGET * 6 / 10))}
OUT=${OUT:-./out}
PY=${PYTHON:-$(command -v python || command -v python3)}
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }

mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
TMP=$(mktemp -d /tmp/gpu_verify.XXXXXX)
trap 'rm -rf "$TMP"' EXIT

rc_tar=0; rc_smi=0; rc_ab=skipped; rc_pytest=skipped
tar -xf "$TAR" -C "$TMP" || rc_tar=$?
INIT=$(find "$TMP" -path '*/distmoe/__init__.py' | sort | head -1)  # normally $TMP/src/...
OLD=${INIT%/distmoe/__init__.py}
echo "old tree: ${OLD:-not found} (from $TAR, tar rc $rc_tar)"

nvidia-smi -L 2>&1 | tee "$OUT/nvidia-smi.txt"; rc_smi=${PIPESTATUS[0]}

if [ -n "$OLD" ] && [ -f "$OLD/distmoe/__init__.py" ]; then
    t=$(( $(left) - 20 ))
    if [ "$t" -gt 30 ]; then
        timeout -k 10 "$t" "$PY" benchmarks/same_bits_ab.py --old "$OLD" --out "$OUT/same_bits" \
            --budget-s "$AB_BUDGET" 2>&1 | tee "$OUT/same_bits.log"
        rc_ab=${PIPESTATUS[0]}
    fi
    export DISTMOE_OLD_SRC="$OLD"
else
    rc_ab="no old tree"
fi

t=$(( $(left) - 5 ))
if [ "$t" -gt 30 ]; then
    timeout -k 10 "$t" "$PY" -m pytest -q -m gpu tests -x --timeout 600 -p no:cacheprovider \
        2>&1 | tee "$OUT/pytest.log"
    rc_pytest=${PIPESTATUS[0]}
else
    rc_pytest="skipped (budget: ${t}s left)"
fi

echo "gpu_verify: tar $rc_tar, nvidia-smi $rc_smi, same_bits_ab $rc_ab" \
     "(0 pass, 1 fail, 2 setup, 3 nondeterministic in both, 124 timeout), pytest $rc_pytest;" \
     "$(( $(date +%s) - START )) s" | tee "$OUT/gpu_verify.txt"
[ "$rc_tar" = 0 ] && [ "$rc_ab" = 0 ] && [ "$rc_pytest" = 0 ]
