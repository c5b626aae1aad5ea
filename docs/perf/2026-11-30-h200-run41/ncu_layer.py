#!/usr/bin/env python3
"""Eager layer steps for Nsight Compute (no torch.profiler, which also wants CUPTI):
``ncu_layer.py SHAPE MODE ROUTING [STEPS]`` runs STEPS (default 3) steps of the bench's layer
(tools/profile_layer.py's ``layer_step``), printing each step's number to stderr. Pick the
kernels with ``ncu --kernel-name regex:... --launch-skip N --launch-count M``."""
import sys

import torch

from distmoe.tools.bench.layer_step import join_group, layer_step

shape, mode, routing = sys.argv[1:4]
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 3
ctx, step, _T = layer_step(shape, mode, join_group(), routing=routing)
with ctx:
    for i in range(steps):
        step(False)
        torch.cuda.synchronize()
        print(f"step {i} done", file=sys.stderr, flush=True)
