"""benchmarks/README.md's table of the shape tools' options (``--shape`` or ``--shapes``,
``--tokens``, ``--mode``, ``--routing``: each tool keeps its own spelling) matches what their
parsers take."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _table() -> dict[str, list[str]]:
    """``{tool: [shapes, tokens, mode, routing]}``, the cells of the README's rows."""
    rows = {}
    for line in (ROOT / "benchmarks" / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1].startswith(("`--shape ", "`--shapes ")):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_readme_table_names_each_tools_options():
    rows = _table()
    assert len(rows) == 10 and "python -m distmoe bench" in rows, sorted(rows)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    helps = {}
    for tool in rows:  # all at once: each process imports torch
        cmd = tool.replace("python", sys.executable, 1).split() if tool.startswith("python") \
            else [sys.executable, tool]
        helps[tool] = subprocess.Popen([*cmd, "--help"], cwd=ROOT, env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for tool, proc in helps.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (tool, err[-2000:])
        usage = " ".join(out.split("\n\n")[0].split())  # argparse wraps the usage lines
        shapes, *others = rows[tool]
        option = shapes.strip("`").split()[0]
        other = "--shapes" if option == "--shape" else "--shape"
        assert f"[{option} " in usage and f"[{other} " not in usage, (tool, usage)
        for cell, name in zip(others, ("--tokens", "--mode", "--routing"), strict=True):
            # a cell opens with the option when the tool has it, with "-" when it has not
            assert cell.startswith(f"`{name}") == bool(re.search(rf"\[{name}[ \]]", usage)), \
                (tool, name, cell)
