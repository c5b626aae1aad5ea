"""Integrations of distmoe into other libraries' models (docs/integrations.md).

* :mod:`distmoe.integrations.transformers`: ``"distmoe"`` as a Hugging Face transformers
  experts implementation (``experts_implementation="distmoe"``). Import it explicitly; this
  package imports nothing, so distmoe does not need transformers installed.
"""
