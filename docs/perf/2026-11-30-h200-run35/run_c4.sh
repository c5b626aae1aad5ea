#!/usr/bin/env bash
# call (x2): NaN debug, kernel tests, layer test, timelines beside vs sequential at fine
set -u
out=/tmp/o; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 scratch/nan_debug.py > $out/nan.log 2>&1; echo "nan rc=$?"; tail -8 $out/nan.log
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_w2_beside.py > $out/t_kernels.log 2>&1
echo "kernels rc=$?"; tail -6 $out/t_kernels.log
timeout 150 python3 -m pytest -x -q -m multigpu tests/ops/test_multigpu.py -k beside > $out/t_multi.log 2>&1
echo "multigpu rc=$?"; tail -2 $out/t_multi.log
P="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/profile_layer.py --shape fine --mode fwd --graph --steps 3"
timeout 100 $P --trace /tmp/tr_b > $out/prof_b.log 2>&1; echo "prof b rc=$?"
timeout 100 $P --trace /tmp/tr_s --set layer:w2_beside=False > $out/prof_s.log 2>&1; echo "prof s rc=$?"
python3 tools/trace_timeline.py /tmp/tr_b.rank0 /tmp/tr_b.rank1 --steps 3 > $out/beside_timeline.txt 2>&1
python3 tools/trace_timeline.py /tmp/tr_s.rank0 /tmp/tr_s.rank1 --steps 3 > $out/seq_timeline.txt 2>&1
grep -n "w13\|w2\|Memcpy\|barrier\|combine" $out/beside_timeline.txt | head -24
tar czf /tmp/g2.tgz -C $out . && cp /tmp/g2.tgz $OUT/
