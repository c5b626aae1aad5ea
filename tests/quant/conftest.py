"""The quant tests import their shared cases (``quant_cases``) as a top-level module: the test
folders are not packages, so this folder goes on sys.path here."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
