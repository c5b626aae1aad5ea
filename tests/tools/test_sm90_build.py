"""Every kernel builds for sm_90, and the grouped GEMMs' production configs do not spill.

The interpreter runs the kernels' Python on the CPU and misses what only the compiler sees (a
constexpr branch ending in ``return`` is built for both values; a descriptor reaching a
pointer-only op) and says nothing about registers. ``python -m distmoe profile --ptxas --check`` compiles
every case of :mod:`distmoe.tools.sm90_build` (the grouped GEMMs' production configs and flag
variants, every other kernel with each flag value its launcher passes, and the persistent Gluon
WGRAD) for sm_90 and reads Triton's bundled ``ptxas -v`` (a production case also fails when
ptxas serializes its wgmma pipeline); it runs as its own process because Triton must be imported
without ``TRITON_INTERPRET`` to build for a GPU target. No GPU is needed (about 30 s).
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
def test_kernels_build_for_sm90_and_production_configs_do_not_spill():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-m", "distmoe", "profile", "--ptxas", "--check"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    lines = [line for line in run.stdout.splitlines() if "regs" in line]
    assert len(lines) >= 45, run.stdout  # every case reported
    assert "device_barrier" in run.stdout and "dense-e32 W2 DGRAD" in run.stdout
    from distmoe.kernels.base.gluon import HAVE_GLUON

    if HAVE_GLUON:  # the Gluon WGRAD's production configs: built, no spill, no serialized wgmma
        assert "qwen3-30b-a3b W13 WGRAD gluon" in run.stdout and "dense-e32 W2 WGRAD gluon" in run.stdout
        # the partial-tile builds at GPT-OSS's D = F = 2880, as the heuristics pick them
        for label in ("gpt-oss-120b W2 WGRAD gluon ws 256x128", "gpt-oss-120b W2 fwd gluon",
                      # the WGRADs' 256 x 128 tiles from 12 MiB per expert, ping-pong, and
                      # two cooperating warpgroups
                      "dense-e32 W13 WGRAD gluon ws 256x128",
                      "qwen3-30b-a3b W2 WGRAD gluon ws pingpong 128x128",
                      "qwen3-30b-a3b T=16384 W13 WGRAD gluon ws 128x128 w8 s5",
                      "gpt-oss-120b W13 DGRAD gluon", "gpt-oss-120b W13 fwd gluon 128x128 coop",
                      "gpt-oss-120b W2 DGRAD gluon split",
                      # the producers in lockstep (W13Config.lockstep, W2DgradConfig's,
                      # W13DgradConfig's), built
                      "deepseek-v3 W13 fwd gluon 128x128 coop s4 training=True lockstep",
                      "deepseek-v3 W2 DGRAD gluon split epi8 x1 s4 scored=True lockstep",
                      "deepseek-v3 W13 DGRAD gluon 128x128 s5 lockstep",
                      # the expert-group order (W2Config's, W13DgradConfig's) at 256 experts
                      "deepseek-v3 W2 fwd gluon 128x128 s6 lockstep expert-groups",
                      "deepseek-v3 W13 DGRAD gluon 128x128 s5 lockstep expert-groups",
                      # the WGRAD's (WgradConfig.lockstep) from 48 MiB an expert
                      "deepseek-v3 W13 WGRAD gluon ws 256x128 lockstep"):
            assert label in run.stdout, label


def test_every_wgmma_serialization_note_counts():
    """ptxas names each cause of a serialized wgmma pipeline with its own code; the report
    must catch all of them (it once matched only C7514 and missed a C7515 build)."""
    from distmoe.tools.sm90_build import wgmma_serialized

    note = ("ptxas info    : ({code}) Potential Performance Loss: wgmma.mma_async instructions "
            "are serialized due to {why} in the function '_gluon_w13_kernel'")
    assert wgmma_serialized(note.format(code="C7514", why="non wgmma instructions touching "
                                        "accumulator registers of a wgmma"))
    assert wgmma_serialized(note.format(code="C7515", why="non wgmma instructions defining "
                                        "accumulator registers of a wgmma between start and end "
                                        "of the pipeline stage"))
    clean = ("ptxas info    : Used 168 registers, used 4 barriers\n"
             "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
    assert not wgmma_serialized(clean)
