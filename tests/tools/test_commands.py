"""``python -m distmoe``: the seven commands, the top-level help listing them (in a process
that sees no GPU) and each command's ``--help``."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distmoe.__main__ import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]


def test_the_seven_commands():
    assert list(COMMANDS) == ["demo", "plan", "bench", "ab", "profile", "tune", "scaling"]


def test_every_command_help_works_without_a_gpu(capsys):
    # the entry point in a process that sees no GPU; each command's help in this process
    # (another process per command would import torch again: seconds of CPU each)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="")
    top = subprocess.run([sys.executable, "-m", "distmoe", "--help"], cwd=ROOT, env=env,
                         text=True, capture_output=True, timeout=180)
    assert top.returncode == 0, top.stderr[-2000:]
    assert top.stdout.startswith("usage: distmoe"), top.stdout[:200]
    assert all(f"    {name} " in top.stdout for name in COMMANDS), top.stdout
    for cmd in COMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            main([cmd, "--help"])
        out = capsys.readouterr().out
        assert exit_info.value.code == 0, (cmd, out[-2000:])
        assert out.startswith(f"usage: distmoe {cmd}"), (cmd, out[:200])


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
