"""Shared pieces of every kernel family (imports nothing from the families).

``config`` (:class:`~distmoe.kernels.base.config.GemmConfig`), ``device`` (device, grid and
launch helpers), ``checks`` (input validation), ``rows`` (host row addresses and tables for the
references), ``tiles`` (shared ``@triton.jit`` helpers), ``gluon`` (Gluon availability and the
shared Gluon ring pieces) and ``interpreter`` (CPU execution through Triton's interpreter).
The rules that pick configs live in :mod:`distmoe.plan`.

Nothing is imported here: :mod:`distmoe` imports ``base.interpreter`` before any kernel is
defined.
"""
