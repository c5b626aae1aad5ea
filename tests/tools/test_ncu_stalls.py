"""``python -m distmoe profile --ncu`` (:mod:`distmoe.tools.ncu_stalls`) on a synthetic ``ncu
--page source --csv`` table: a warp-specialised kernel split into its partitions (the
out-of-line retry loops given back to the partition they return to), a kernel with no
partitions, the polled barrier named, and clear errors."""

import argparse
import csv
import gzip
import io

from distmoe.tools import ncu_stalls as mod
from distmoe.tools import profile


def _profile(*argv):
    return profile.run(profile.add_arguments(argparse.ArgumentParser()).parse_args(list(argv)))

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "# Samples", "stall_long_sb",
          "stall_barrier", "stall_long_sb (Not Issued)"]


def _table(kernels):
    """CSV text of ``{name: [(address, source, samples, long_sb, barrier), ...]}``."""
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    for name, rows in kernels.items():
        w.writerow(["Kernel Name", name, ""])
        w.writerow(HEADER)
        for addr, src, n, lsb, bar in rows:
            w.writerow([hex(addr), "      " + src, n, n, n, lsb, bar, lsb])
    return buf.getvalue()


# consumer (default partition) at 0x100-0x140, producer at 0x160-0x1a0, the last EXIT at
# 0x1a0, then two retry loops: the first returns into the consumer, the second into the
# producer, and a trap branching to itself
WS = [
    (0x100, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x100], R2", 1, 1, 0),
    (0x110, "@!P0  BRA 0x1b0", 50, 50, 0),
    (0x120, "HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24, gsb0", 5, 0, 5),
    (0x130, "BRA 0x100", 0, 0, 0),
    (0x140, "NOP", 0, 0, 0),
    (0x150, "USETMAXREG.DEALLOC.CTAPOOL 0x38", 0, 0, 0),
    (0x160, "SYNCS.PHASECHK.TRANS64.TRYWAIT P6, [UR4+0x120], R3", 2, 2, 0),
    (0x170, "@!P6  BRA 0x1d0", 30, 30, 0),
    (0x180, "UTMALDG.2D [UR24], [UR30]", 8, 0, 8),
    (0x190, "@!P1  EXIT", 0, 0, 0),
    (0x1a0, "EXIT", 0, 0, 0),
    (0x1b0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x100], R2", 1, 1, 0),
    (0x1c0, "BRA 0x120", 4, 4, 0),
    (0x1d0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P6, [UR4+0x120], R3", 1, 1, 0),
    (0x1e0, "BRA 0x180", 3, 3, 0),
    (0x1f0, "BRA 0x1f0", 0, 0, 0),
]
PLAIN = [(0x10, "LDG.E R2, [R4.64]", 7, 7, 0), (0x20, "EXIT", 0, 0, 0)]


def test_partitions_and_retry_loops():
    kernels = mod.read_tables(_table({"ws_kernel": WS, "plain": PLAIN}))
    assert list(kernels) == ["ws_kernel", "plain"]
    parts = mod.partitions(kernels["ws_kernel"])
    assert [p.setting for p in parts] == ["", "USETMAXREG.DEALLOC.CTAPOOL 0x38"]
    assert [hex(i.address) for i in parts[0].instrs] == [
        "0x100", "0x110", "0x120", "0x130", "0x140", "0x1b0", "0x1c0", "0x1f0"]
    assert [hex(i.address) for i in parts[1].instrs] == [
        "0x150", "0x160", "0x170", "0x180", "0x190", "0x1a0", "0x1d0", "0x1e0"]
    assert (parts[0].samples, parts[1].samples) == (61, 44)
    assert sum(p.samples for p in parts) == sum(r[2] for r in WS)  # every sample, once
    assert [len(p.instrs) for p in mod.partitions(kernels["plain"])] == [2]


def test_report_names_the_polled_barriers(tmp_path, capsys):
    path = tmp_path / "sass.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(_table({"ws_kernel": WS, "plain": PLAIN}))
    assert _profile("--ncu", str(path), "--top", "2", "--kernel", "ws_") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ws_kernel: 16 instructions, 105 samples"
    assert out[1].startswith("  partition 0 (default): 61 samples, 58.1% of the kernel")
    assert "82.0%" in out[2] and "@!P0  BRA 0x1b0" in out[2] and "(polls [UR4+0x100])" in out[2]
    assert "long_sb 100%" in out[2]
    assert "8.2%" in out[3] and "HGMMA" in out[3] and "barrier 100%" in out[3]
    assert out[4].startswith("  partition 1 (USETMAXREG.DEALLOC.CTAPOOL 0x38): 44 samples")
    assert "(polls [UR4+0x120])" in out[5]
    assert not any("plain" in line for line in out)


def test_clear_errors(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text('"Kernel Name","k",\n"Address","Source"\n"0x10","NOP"\n')
    assert _profile("--ncu", str(bad)) == 1
    assert "has no 'Warp Stall Sampling (All Samples)' column" in capsys.readouterr().err
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert _profile("--ncu", str(empty)) == 1
    assert "no kernel table in" in capsys.readouterr().err
    orphan = tmp_path / "orphan.csv"
    orphan.write_text('"0x10","NOP","3"\n')
    assert _profile("--ncu", str(orphan)) == 1
    assert "a table row before its kernel's name and header" in capsys.readouterr().err
    assert _profile("--ncu", str(tmp_path / "missing.csv")) == 2
    assert "--ncu " in capsys.readouterr().err
    assert _profile("--ncu", str(bad), "--top", "0") == 2
    assert capsys.readouterr().err == "distmoe profile: error: --top (0) must be >= 1\n"
