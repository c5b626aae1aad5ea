#!/usr/bin/env bash
# call 5 (x2): the two-GPU tests after launch's file-store rendezvous; the Gluon pair at
# 64 rows per local expert at EP=2 (fine, T=512 per rank: the new heuristic against the
# Triton pair, with the EP=1 share)
set -u
out=/tmp/o5; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
timeout 220 python3 -m pytest -q -m multigpu tests/ops/test_multigpu.py tests/runtime/test_heap.py > $out/t_multi.log 2>&1
echo "multigpu rc=$?"; tail -n 2 $out/t_multi.log
TRI="w13:inference:gluon=False+w2:gluon=False,block_n=256,num_warps=8,num_stages=4"
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share"
timeout 150 $R --shape fine --tokens 512 --rounds 21 --iters 20 --variant tri=$TRI > $out/ab_fine_512_ep2.log 2>&1
echo "ab fine T=512 EP=2 rc=$?"; grep -E "^ +(base|tri|ep1share) |_w13_cfg|_w2_cfg" $out/ab_fine_512_ep2.log | head -8
tar czf /tmp/g5.tgz -C $out . && cp /tmp/g5.tgz $OUT/
