"""The grouped GEMMs build for sm_90, and the production configs do not spill registers.

The interpreter runs the kernels' Python on the CPU and misses what only the compiler sees (a
constexpr branch ending in ``return`` is built for both values; a descriptor reaching a
pointer-only op) and says nothing about registers. ``tools/ptxas_report.py --check`` compiles
every case of :func:`distmoe.tools.sm90_build.grouped_gemm_cases` for sm_90 and reads Triton's
bundled ``ptxas -v``; it runs as its own process because Triton must be imported without
``TRITON_INTERPRET`` to build for a GPU target. No GPU is needed.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ptxas() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not _ptxas().exists(), reason="this triton build ships no ptxas")
def test_grouped_gemms_build_for_sm90_and_production_configs_do_not_spill():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "ptxas_report.py"), "--check"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    lines = [line for line in run.stdout.splitlines() if "regs" in line]
    assert len(lines) >= 20, run.stdout  # every case reported (production and variants)
