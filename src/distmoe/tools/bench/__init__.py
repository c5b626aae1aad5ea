"""Benchmark harness of distmoe: ``python -m distmoe bench`` (see benchmarks/README.md).

Modules:
    timing      CUDA-graph and eager window timing (``--timing``), host time per call,
                interleaved rounds, CPU timing
    models      useful FLOPs, modeled HBM and NVLink bytes, roofline equations
    workloads   named shapes, routing generator with an imbalance knob, layer inputs
    baseline    the torch baseline (gather + torch._grouped_mm + SwiGLU + scatter-add; EP>1
                with all_to_all_single)
    providers   distmoe / torch / torch_compile behind one calling convention
    groups      one-rank process group for EP = 1, torchrun's world for EP > 1
    ceilings    dense bf16 and fp8 matmul, device and peer copy, measured in the same run
    micro       grouped GEMM vs padded BMM, matched projection, histogram effect
    routing_micro  routing-table construction per implementation (``--routing-micro``)
    layer_step  one layer step on shared inputs, for ``distmoe ab`` and ``distmoe profile``
    report      CSV / JSON / PNG / text outputs, markdown tables per device (``--tables``)
    cli         ``add_arguments(parser)`` and ``run(args)``
"""
