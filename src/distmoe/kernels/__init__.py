"""Layer 3: Triton kernels (grouped GEMMs with gather prologues and scatter epilogues, owner
combine, backward DGRAD/WGRAD). Importing :mod:`distmoe` first selects Triton's interpreter on
machines without CUDA."""
