#!/usr/bin/env bash
# run 59, call 4 (any Hopper GPU): which of call 3's expert-group GPU tests hang (call 3's
# pytest -n 8 stopped at its 240 s timeout after two tests): four at a time, each under its
# own timeout (rc 124: timed out), a non-expert-group W2 test among them.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
f=tests/kernels/test_forward_kernels.py b=tests/kernels/test_backward_kernels.py
one() {  # NODEID LOGNAME
  timeout ${T:-100} python3 -m pytest -q -m gpu -p no:cacheprovider -x "$1" > $OUT/$2.log 2>&1
  echo "$2 rc=$? $(tail -n 1 $OUT/$2.log)"
}
t0=$SECONDS
one "$f::test_gpu_w2_gluon_programs_walk_many_tiles[3-128x128]" w2_walk3 &
one "$f::test_gpu_w2_gluon_expert_groups[1-free-128x128]" w2eg_1 &
one "$f::test_gpu_w2_gluon_expert_groups[3-free-128x128]" w2eg_3 &
one "$f::test_gpu_w2_gluon_expert_groups[None-free-128x128]" w2eg_sms &
wait; echo "group 1 done at $((SECONDS - t0)) s"
one "$b::test_gluon_w13_dgrad_expert_groups[1-free-pingpong]" w13deg_1 &
one "$b::test_gluon_w13_dgrad_expert_groups[3-free-pingpong]" w13deg_3 &
one "$b::test_gluon_w13_dgrad_expert_groups[None-free-pingpong]" w13deg_sms &
one "$f::test_gpu_w2_gluon_expert_groups[3-free-128x256coop]" w2eg_3coop &
wait; echo "group 2 done at $((SECONDS - t0)) s"
