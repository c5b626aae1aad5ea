"""``python -m distmoe``: the seven commands, each one's ``--help`` without a GPU (in parallel:
each process imports torch), and the top-level help listing them."""

import os
import re
import subprocess
import sys
from pathlib import Path

from distmoe.__main__ import COMMANDS

ROOT = Path(__file__).resolve().parents[2]


def test_the_seven_commands():
    assert list(COMMANDS) == ["demo", "plan", "bench", "ab", "profile", "tune", "scaling"]


def test_every_command_help_works_without_a_gpu():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="")
    procs = {cmd: subprocess.Popen([sys.executable, "-m", "distmoe", *cmd.split(), "--help"],
                                   cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE)
             for cmd in ["", *COMMANDS]}
    for cmd, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, (cmd, err[-2000:])
        assert out.startswith(f"usage: distmoe {cmd}".rstrip()), (cmd, out[:200])
        if not cmd:
            assert all(f"    {name} " in out for name in COMMANDS), out


def test_bench_help_speaks_plainly():
    """No references to a specification's sections or equations or to the old shape names;
    what each provider and ceiling is, and that CPU times are the interpreter's."""
    import argparse

    from distmoe.tools.bench import cli

    text = cli.add_arguments(argparse.ArgumentParser(prog="distmoe bench")).format_help()
    for jargon in ("seed 000", "A.7", "eq. 94", "issue-a", "issue-b", r"\bfine\b"):
        assert not re.search(jargon, text), jargon
    for plain in ("torch_compile  torch.compile of that function", "dense bf16 matrix multiply",
                  "device copy", "Triton's interpreter"):
        assert plain in text, plain
