"""Where each warp role of a kernel waits: Nsight Compute's per-instruction stall samples,
split by warp-specialised partition (``python -m distmoe profile --ncu TABLE``).

Usage (on any machine, over a table exported where the report was taken)::

    ncu --section SourceCounters ... -o rep python3 ...            # on the GPU machine
    ncu --import rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python -m distmoe profile --ncu sass.csv[.gz] [--kernel REGEX] [--top 6]

Why: a warp-specialised Gluon kernel runs a producer and one or two consumer warpgroups in
one SASS body; Nsight Compute's stall totals mix them, so "83% long scoreboard" does not say
whether the consumers wait for data or the producer for a free stage. Here each kernel's SASS is split where a partition begins (``USETMAXREG``, the
register reallocation Gluon's ``warp_specialize`` emits at each worker's entry, after an
unconditional branch), and the out-of-line blocks after the last ``EXIT`` (the barrier
wait's retry loops) go to the partition their closing branch returns to. A kernel with no
``USETMAXREG`` is one partition. Printed per partition: its samples and share of the kernel,
its register setting, and its top instructions with their share of the partition and
dominant stall reasons. Which partition is the producer is read from the code (its
``UTMALDG`` / ``LDGSTS`` issues and its smaller register budget), not guessed here.
"""

import csv
import gzip
import io
import re
import sys
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"
_BRANCH = re.compile(r"^\s*BRA\s+(0x[0-9a-fA-F]+)\s*$")  # unconditional, to an address
_ANY_BRANCH = re.compile(r"\bBRA\s+(0x[0-9a-fA-F]+)\s*$")
_POLLED = re.compile(r"TRYWAIT\s+\S+\s+(\[[^\]]+\])")


@dataclass
class Instr:
    address: int
    source: str
    samples: int
    reasons: dict[str, int]


@dataclass
class Partition:
    index: int
    setting: str  # the USETMAXREG instruction at its entry, or "" for the default partition
    instrs: list[Instr] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(i.samples for i in self.instrs)


def read_tables(text: str) -> dict[str, list[Instr]]:
    """The SASS table of each kernel in ``ncu --page source --csv`` output: a ``"Kernel
    Name"`` row, a header row starting ``"Address"``, then one row per instruction."""
    kernels: dict[str, list[Instr]] = {}
    name, header = None, None
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            name, header = row[1], None
            kernels[name] = []
            continue
        if row[0] == "Address":
            header = {h: i for i, h in enumerate(row)}
            if SAMPLES not in header:
                raise ValueError(f"the table of {name!r} has no {SAMPLES!r} column: export it "
                                 "from a report taken with --section SourceCounters")
            continue
        if name is None or header is None:
            raise ValueError(f"a table row before its kernel's name and header: {row[:3]}")

        reasons = {h: _count(row[i]) for h, i in header.items()
                   if h.startswith("stall_") and "Not Issued" not in h}
        kernels[name].append(Instr(int(row[header["Address"]], 16),
                                   row[header["Source"]].strip(),
                                   _count(row[header[SAMPLES]]), reasons))
    return kernels


def _count(cell: str) -> int:
    """A sample count as ncu writes it (``1,234``; blank or ``-``: none)."""
    v = cell.replace(",", "")
    return int(v) if v.isdigit() else 0


def partitions(instrs: list[Instr]) -> list[Partition]:
    """Split one kernel's instructions into warp-specialised partitions (see the module
    docstring); every instruction lands in exactly one."""
    exits = [k for k, ins in enumerate(instrs) if ins.source.split()[-1:] == ["EXIT"]
             and not ins.source.startswith("@")]
    end = exits[-1] + 1 if exits else len(instrs)
    parts = [Partition(0, "")]
    after_jump = False
    for ins in instrs[:end]:
        op = ins.source.split()[0] if ins.source else ""
        if after_jump and op.startswith("USETMAXREG"):
            parts.append(Partition(len(parts), ins.source))
        if op != "NOP":
            after_jump = bool(_BRANCH.match(ins.source)) or op == "EXIT"
        parts[-1].instrs.append(ins)
    starts = [(p.instrs[0].address, p) for p in parts if p.instrs]

    def owner(address: int) -> Partition:
        found = parts[0]
        for start, part in starts:
            if start <= address:
                found = part
        return found

    block: list[Instr] = []
    for ins in instrs[end:]:  # out-of-line blocks: each closed by a branch back
        block.append(ins)
        m = _BRANCH.match(ins.source)
        if m:
            target = int(m.group(1), 16)
            home = parts[0] if target == ins.address else owner(target)  # a trap: parts[0]
            home.instrs.extend(block)
            block = []
    parts[0].instrs.extend(block)
    return parts


def polled_barrier(ins: Instr, by_address: dict[int, Instr]) -> str:
    """The mbarrier a branch into a ``TRYWAIT`` retry loop polls (``[UR24+0x34000]``: the
    barrier's shared-memory address, which tells a kernel's barriers apart), else ``""``."""
    m = _ANY_BRANCH.search(ins.source)
    target = by_address.get(int(m.group(1), 16)) if m else None
    polled = _POLLED.search(target.source) if target is not None else None
    return polled.group(1) if polled else ""


def report(kernels: dict[str, list[Instr]], top: int, pattern: str | None = None) -> str:
    """The text :func:`main` prints: per kernel (``pattern``: a regex its name must match),
    per partition, the ``top`` instructions by stall samples."""
    out = []
    for name, instrs in kernels.items():
        if pattern and not re.search(pattern, name):
            continue
        by_address = {i.address: i for i in instrs}
        total = sum(i.samples for i in instrs)
        out.append(f"{name}: {len(instrs)} instructions, {total} samples")
        for part in partitions(instrs):
            n = part.samples
            setting = f" ({part.setting})" if part.setting else " (default)"
            out.append(f"  partition {part.index}{setting}: {n} samples, "
                       f"{100 * n / max(total, 1):.1f}% of the kernel")
            for ins in sorted(part.instrs, key=lambda i: -i.samples)[:top]:
                if not ins.samples:
                    break
                why = sorted(ins.reasons.items(), key=lambda kv: -kv[1])[:2]
                why_s = ", ".join(f"{k[6:]} {100 * v / ins.samples:.0f}%" for k, v in why if v)
                polled = polled_barrier(ins, by_address)
                out.append(f"    {100 * ins.samples / max(n, 1):5.1f}%  {ins.address:#x}  "
                           f"{ins.source[:58]:58s}  {why_s}"
                           + (f"  (polls {polled})" if polled else ""))
    return "\n".join(out)


def summarize(table: str, top: int = 6, pattern: str | None = None) -> int:
    """Print :func:`report` of the table file ``table`` (``.gz`` read as gzip); returns the
    exit status (1 with a line on stderr for a table without stall samples, or none)."""
    opener = gzip.open if table.endswith(".gz") else open
    try:
        with opener(table, "rt") as f:
            text = f.read()
    except OSError as exc:
        print(f"distmoe profile: error: --ncu {table}: cannot read it: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    try:
        kernels = read_tables(text)
    except ValueError as exc:
        print(f"distmoe profile: --ncu {table}: {exc}", file=sys.stderr)
        return 1
    if not kernels:
        print(f"distmoe profile: --ncu: no kernel table in {table}", file=sys.stderr)
        return 1
    print(report(kernels, top, pattern))
    return 0
