#!/usr/bin/env python3
"""Run 58's Nsight Compute driver for a layer variant: ``ncu_layer_variant.py SHAPE MODE
ROUTING [SPEC...]`` builds the bench's layer (one GPU), applies ``tools/ab_interleaved.py``'s
``--variant`` specs (e.g. ``w13:inference:group_m=1``) and runs 3 eager steps, so that
``ncu --kernel-name regex:... --launch-skip 2 --launch-count 1`` profiles the third step's
kernel under that variant. ``SHAPE@T`` (run 60): the shape with T tokens per rank."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "tools"))
from ab_interleaved import INPUT_BUFFER, variant_configs  # noqa: E402

from distmoe.tools.bench.layer_step import join_group, layer_step  # noqa: E402

shape, mode, routing, *specs = sys.argv[1:]
shape, _, tokens = shape.partition("@")
ctx, step, _T = layer_step(shape, mode, join_group(), routing=routing,
                           tokens=int(tokens) if tokens else None)
with ctx:
    for attr, cfg in variant_configs(ctx, specs, mode != "fwd").items():
        if attr != INPUT_BUFFER:
            setattr(ctx, attr, cfg)
    for i in range(3):
        step(False)
        torch.cuda.synchronize()
        print(f"step {i} done", file=sys.stderr, flush=True)
