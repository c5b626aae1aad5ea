#!/usr/bin/env bash
# run 53, call 3: the W2 DGRAD heuristic now sets lockstep at 96-191 rows per expert where the
# rank's W2 weights total >= 3 GiB (call 2's kernel micro). Its GPU heuristic test; then the
# layer's fwd+bwd against the option off, interleaved: deepseek-v3 (only where the GPU holds
# it: an H200; also against all three lockstep options off), deepseek-v4-flash sampled and
# exact; and gpt-oss-120b with the W13 DGRAD on the Gluon kernel in lockstep (call 2: 1.0039)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_backward_kernels.py \
  -k "w2_dgrad_heuristic or w2_dgrad_lockstep" > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 2 $OUT/tests.log
off="off=w2_dgrad:lockstep=False"
all="alloff=w13:lockstep=False+w2:lockstep=False+w2_dgrad:lockstep=False"
g="w13gls=w13_dgrad:gluon=True,block_n=128,num_warps=4,num_stages=5,lockstep=True"
specs=()
[ "$mem" -gt 100000 ] && specs+=("deepseek-v3 sampled 7 $off $all")
specs+=("deepseek-v4-flash sampled 9 $off" "deepseek-v4-flash exact 9 $off"
        "gpt-oss-120b sampled 11 $g")
for spec in "${specs[@]}"; do
  set -- $spec
  left=$((560 - (SECONDS - t0))); [ $left -lt 40 ] && break
  vs=(); for v in "${@:4}"; do vs+=(--variant "$v"); done
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 \
    --rounds $3 "${vs[@]}" > $OUT/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_$2.log | head -3
done
