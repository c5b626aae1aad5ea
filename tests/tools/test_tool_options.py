"""The commands that take bench shapes spell their options alike where they mean the same:
``--shape NAME`` for one layer (ab, profile), ``--shapes NAME...`` for a list (bench, tune,
profile --ptxas), ``--tokens``, ``--mode`` and ``--routing`` where the command has them. The
table below is what benchmarks/README.md's table of the commands states."""

import argparse
import importlib

import pytest

#: command -> (shapes option, has --tokens, has --mode, --routing choices)
OPTIONS = {
    "bench": ("--shapes", True, True, ("exact", "sampled")),
    "ab": ("--shape", True, True, ("exact", "sampled")),
    "profile": ("--shape", True, True, ("exact", "sampled")),
    "tune": ("--shapes", False, False, ("random", "balanced")),
}
MODULES = {"bench": "bench.cli", "ab": "ab", "profile": "profile", "tune": "tune"}


def _parser(command):
    mod = importlib.import_module(f"distmoe.tools.{MODULES[command]}")
    return mod.add_arguments(argparse.ArgumentParser(prog=f"distmoe {command}"))


@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_shape_commands_spell_their_options_alike(command):
    shapes, tokens, mode, routing = OPTIONS[command]
    parser = _parser(command)
    options = parser._option_string_actions
    assert shapes in options
    assert ("--tokens" in options) == tokens and ("--mode" in options) == mode
    assert tuple(options["--routing"].choices) == routing
    if shapes == "--shape":  # one layer: a list of shapes is refused
        assert options["--shape"].nargs is None
    else:
        assert options["--shapes"].nargs == "+"


def test_shape_choices_are_the_current_names():
    from distmoe.tools.bench.workloads import SHAPES

    for command in OPTIONS:
        options = _parser(command)._option_string_actions
        key = OPTIONS[command][0]
        choices = set(options[key].choices)
        assert set(SHAPES) <= choices and not {"issue-a", "issue-b", "fine"} & choices
