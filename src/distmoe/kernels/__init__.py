"""Layer 3: the Triton and Gluon kernels, grouped by GEMM family plus data movement. Importing
:mod:`distmoe` first selects Triton's interpreter on machines without CUDA.

* ``base/``: what every family imports (and nothing from them): launch configs, device and
  grid helpers, input checks, host row helpers, shared ``@triton.jit`` tile helpers, the shared
  Gluon pieces and the interpreter setup. The rules that pick configs live in
  :mod:`distmoe.plan`.
* ``w13_forward/``: gather + W13 + SwiGLU (Triton and Gluon), and the two-launch phase order.
* ``w2_forward/``: W2 with a row-scatter epilogue (Triton and Gluon; the Gluon kernel body also
  runs the W13 DGRAD).
* ``w2_dgrad/``: W2 DGRAD with the SwiGLU backward in its epilogue (Triton and Gluon).
* ``w13_dgrad/``: W13 DGRAD with a scatter epilogue (Triton, and Gluon on the W2 forward's
  kernel body).
* ``wgrad/``: the grouped WGRAD of both backward GEMMs (Triton and Gluon).
* ``mega/``: W13 and W2 fused into one persistent Gluon kernel (inference).
* ``grouped/``: a plain bf16 grouped GEMM over row segments (``distmoe.grouped_mm``).
* ``scaled/``: grouped GEMMs on block-scaled operands (MXFP8 with 32-wide K steps promoted
  into fp32; NVFP4 weights decoded to bf16; Triton), run by the low-precision inference
  layer (:mod:`distmoe.ops.lowp`).
* ``movement/``: data movement: token pulls, combine, id publishing, offset copies, row
  regathers, route gradients, call counters, the slot cursor.

Each family's ``__init__`` re-exports its config class and launchers; ``base/__init__`` imports
nothing, so that importing :mod:`distmoe.kernels.base.interpreter` defines no kernel.
"""
