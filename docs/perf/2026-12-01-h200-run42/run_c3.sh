#!/usr/bin/env bash
# run 42, calls 3-4 (the same warm H200): the WGRAD at >= 1024 rows per expert, the plain
# 128 x 256 pick (base) against the warp-specialised 128 x 128 tile with two cooperating
# warpgroups (ws8), layer fwd+bwd, interleaved. Call 3: issue-a exact; call 4: issue-a
# sampled and fine at T=16384 (1024 rows per expert) sampled.
export PYTHONPATH=src PYTHONUNBUFFERED=1
V="--variant ws8=wgrad:block_out_n=128,num_stages=5,specialized=True"
timeout 110 python3 tools/ab_interleaved.py --mode fwdbwd --shape issue-a --routing exact \
  --rounds 13 --iters 10 $V > $OUT/ab_issue-a_exact.log 2>&1
timeout 50 python3 tools/ab_interleaved.py --mode fwdbwd --shape issue-a --routing sampled \
  --rounds 13 --iters 10 $V > $OUT/ab_issue-a_sampled.log 2>&1
timeout 45 python3 tools/ab_interleaved.py --mode fwdbwd --shape fine --tokens 16384 \
  --routing sampled --rounds 9 --iters 10 $V > $OUT/ab_fine_t16384.log 2>&1
grep -hE "^ +(base|ws8) " $OUT/*.log
