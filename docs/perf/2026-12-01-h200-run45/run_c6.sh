#!/usr/bin/env bash
# run 45, call 6 (one H200): the one-process torchrun path on the GPU after 3e08f82 (it hung
# before: a store of its own waited on the agent's): ab_interleaved --replay and the bench
# under torch.distributed.run --nproc-per-node=1 (NCCL, one rank)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node=1 tools/ab_interleaved.py \
  --shape issue-b --mode fwdbwd --routing sampled --rounds 7 --iters 10 --replay > $OUT/ab_torchrun1.log 2>&1
echo "ab rc=$? at $((SECONDS - t0)) s"; grep -E "EP=|layer:|^ +(base|replay) " $OUT/ab_torchrun1.log
timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node=1 -m distmoe bench --mode fwd \
  --shapes fine --providers distmoe --no-ceilings --no-plots --out $OUT/bench1 > $OUT/bench_torchrun1.log 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"; grep -E "distmoe +fine|ep_size|error" $OUT/bench_torchrun1.log | head
