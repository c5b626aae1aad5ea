"""Shared by the kernel tests: the family folders (``w13_forward/``, ``w2_dgrad/``, ...) mirror
``src/distmoe/kernels`` and import the shared cases of this folder (``kernel_cases`` for the
forward kernels, ``backward_cases`` for the backward ones) as top-level modules. The test folders
are not packages (pytest's default import mode puts each test file's own folder on sys.path), so
this folder goes on sys.path here."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
