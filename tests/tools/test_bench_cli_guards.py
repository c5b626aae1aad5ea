"""Command line guards of ``python -m distmoe bench``: no GPU, the CPU shape rule, output paths
checked before measuring, the exit status of failed cases, the earlier-run notice."""

import argparse

import pytest
import torch

from distmoe.tools.bench import cli, report


def _parse(argv):
    return cli.add_arguments(argparse.ArgumentParser()).parse_args(argv)


class _Measured(Exception):
    """Raised by the patched group set-up: the command got past its checks."""


@pytest.fixture
def no_measuring(monkeypatch):
    """Fail loudly if a command starts measuring (the process group comes first)."""

    def refuse(*a, **k):
        raise _Measured

    monkeypatch.setattr(cli, "init_single_process_group", refuse)
    monkeypatch.setattr(cli, "launched_by_torchrun", lambda: False)


def test_auto_device_without_cuda_is_a_usage_error(monkeypatch, capsys, no_measuring):
    from distmoe.__main__ import main as distmoe_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distmoe_main(["bench"]) == 2  # python -m distmoe bench (default --device auto)
    err = capsys.readouterr().err
    assert err == (
        "distmoe bench: error: bench needs a CUDA GPU (none found); for a harness smoke run "
        "on CPU: --device cpu --shapes smoke --providers torch\n"
    )
    assert cli.main(["--shapes", "smoke"]) == 2  # python -m distmoe.tools.bench
    assert "bench needs a CUDA GPU (none found)" in capsys.readouterr().err
    assert cli.main(["--device", "cuda"]) == 2
    assert "--device cuda requested but CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "source"),
    [
        ([], "the default suite selects dense-e32 qwen3-30b-a3b-t2048 qwen3-30b-a3b deepseek-v3"),
        (["--full"], "--full selects deepseek-v3"),
        (["--shapes", "smoke", "all"], "--shapes all selects deepseek-v3"),
    ],
)
def test_cpu_device_refuses_shapes_it_was_not_given(argv, source, capsys, no_measuring):
    assert cli.run(_parse(["--device", "cpu", *argv])) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "distmoe bench: error: --device cpu runs shapes other than smoke only when --shapes "
        "names them, and " + source
    ), err
    assert err.rstrip().endswith("--device cpu --shapes smoke --providers torch")
    assert err.count("\n") == 1


def test_cpu_device_warns_for_named_gpu_shapes(capsys, no_measuring):
    assert cli.check_cpu_shapes(_parse(["--device", "cpu", "--shapes", "smoke"])) == ""
    assert cli.check_cpu_shapes(_parse(["--device", "cuda"])) == ""
    assert cli.check_cpu_shapes(_parse(["--device", "auto", "--full"])) == ""
    with pytest.raises(_Measured):  # named explicitly: it runs, after the warning
        cli.run(_parse(["--device", "cpu", "--shapes", "smoke", "dense-e32", "--out", "x"]))
    err = capsys.readouterr().err
    assert err.startswith(
        "distmoe bench: warning: --device cpu with GPU-sized shape(s) dense-e32: on the CPU"
    )
    assert "will take very long" in err


def test_out_and_archive_checked_before_measuring(tmp_path, monkeypatch, capsys, no_measuring):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    adir = tmp_path / "adir"
    adir.mkdir()
    base = ["--device", "cpu", "--shapes", "smoke", "--providers", "torch"]
    cases = [
        (["--out", str(afile)], f"--out ({afile}) must be a writable directory or one that "
         f"can be created: {afile} is an existing file"),
        (["--out", str(afile / "sub")], f"--out ({afile / 'sub'}) must be a writable "
         f"directory or one that can be created: {afile} is an existing file"),
        (["--out", str(adir), "--archive", str(afile / "x.tar.gz")],
         f"--archive ({afile / 'x.tar.gz'}) must be in a writable directory or one that can "
         f"be created: {afile} is an existing file"),
        (["--out", str(adir), "--archive", str(adir)],
         f"--archive ({adir}) must name a file to write, not an existing directory"),
    ]
    for extra, message in cases:
        assert cli.run(_parse([*base, *extra])) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith(f"distmoe bench: error: {message}"), err
        assert err.count("\n") == 1
    # valid: an existing directory, directories still to create, an archive beside them
    cli.check_output_paths(adir, str(tmp_path / "new" / "a.tar.gz"))
    cli.check_output_paths(tmp_path / "new" / "deeper", str(adir / "a.tar.gz"))
    cli.check_output_paths(adir, None)
    assert not (tmp_path / "new").exists()  # checking creates nothing
    monkeypatch.setattr(cli.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=r"--out \(.*\) must be a writable directory .*: "
                       r"directory .*adir is not writable"):
        cli.check_output_paths(adir / "sub", None)


def test_exit_status_and_summary_of_failed_cases(tmp_path, monkeypatch, capsys):
    """A failing case is a result; the run exits 1 only when no case succeeded, and says how
    many failed. A second run into the same --out names the files it replaces."""
    real_benchmark = cli.benchmark_modes
    calls = []

    def second_call_fails(step, **kw):
        calls.append(kw)
        if len(calls) == 2:
            raise RuntimeError("forced failure")
        return real_benchmark(step, **kw)

    monkeypatch.setattr(cli, "benchmark_modes", second_call_fails)
    out = tmp_path / "bench"
    common = ["--shapes", "smoke", "--device", "cpu", "--providers", "torch", "--warmup", "1",
              "--windows", "1", "--iters", "1", "--no-plots", "--no-ceilings", "--out", str(out)]
    assert cli.run(_parse([*common, "--mode", "both"])) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == "1 of 2 cases failed"
    rows = report.read_cases_csv(out / "cases.csv")
    assert [(r["mode"], r["status"]) for r in rows] == [("fwd", "ok"), ("fwdbwd", "failed")]
    assert "RuntimeError: forced failure" in rows[1]["note"]

    (out / "micro.csv").write_text("stale\n")
    monkeypatch.setattr(cli, "benchmark_modes", lambda step, **kw: (_ for _ in ()).throw(
        RuntimeError("forced failure")))
    assert cli.run(_parse([*common, "--mode", "fwd"])) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0] == (
        f"distmoe bench: note: --out {out} holds files of an earlier run; this run replaces: "
        "cases.csv ceilings.csv results.json; keeps (not written by this run): micro.csv; "
        "nothing is deleted"
    )
    printed = captured.out.splitlines()
    assert printed[-2:] == ["1 of 1 cases failed", "no case succeeded (1 failed): exit status 1"]
    assert "left from an earlier run (not written by this one): micro.csv" in printed
    assert (out / "micro.csv").read_text() == "stale\n"  # nothing deleted
    assert [r["status"] for r in report.read_cases_csv(out / "cases.csv")] == ["failed"]


def test_rank_share_of_under_torchrun(monkeypatch, capsys, tmp_path):
    """--rank-share-of is refused where torchrun started several ranks (each runs its share
    already), before any group is joined; a one-process torchrun run may take it."""
    from distmoe.__main__ import main as distmoe_main

    joined = []

    def join(*a, **k):
        joined.append(a)
        raise _Measured

    monkeypatch.setattr(cli, "init_torchrun_group", join)
    monkeypatch.setattr(cli, "launched_by_torchrun", lambda: True)
    argv = ["bench", "--device", "cpu", "--shapes", "smoke", "--providers", "torch",
            "--rank-share-of", "2", "--out", str(tmp_path / "b")]
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distmoe_main(argv) == 2 and not joined
    assert "--rank-share-of (2) is for EP=1 runs" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(_Measured):
        distmoe_main(argv)
    assert len(joined) == 1
