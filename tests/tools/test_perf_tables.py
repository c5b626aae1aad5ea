"""Markdown tables of bench results (docs/performance.md's current figures): rows, newest file
per case, devices apart, legacy shape names, footnotes and the command-line entry."""

import json

import pytest

from distmoe.tools.bench import report

H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"


def _case(provider, shape="issue-a", mode="fwdbwd", routing="exact", iter_ms=2.0, **kw):
    case = dict(
        provider=provider,
        status="ok",
        shape=shape,
        tokens=8192,
        hidden=4096,
        ffn=2048,
        num_experts=32,
        top_k=8,
        ep_size=1,
        imbalance=1.0,
        precision="bf16",
        mode=mode,
        routing=routing,
        timing_method="cuda_graph",
        iter_ms=iter_ms,
        tflops=500.0,
        pct_dense=70.4,
        pct_dense_sustained=81.6,
    )
    case.update(kw)
    return case


def _results(tmp_path, name, *, gpu, date, cases, command=None):
    path = tmp_path / name / "results.json"
    path.parent.mkdir(parents=True)
    env = dict(
        gpu=gpu,
        gpus=[dict(index=0, name=gpu)],
        torch="2.11.0+cu130",
        triton="3.6.0",
        git_sha="0123456789abcdef0123456789abcdef01234567",
        date_utc=date,
        command=command or "/opt/venv/bin/python3 -m distmoe bench --mode fwdbwd",
    )
    timing = dict(num_warmup=10, num_windows=5, iters_per_window=30, use_cuda_graph=True)
    path.write_text(json.dumps(dict(environment=env, timing=timing, cases=cases)))
    return path


def _rows(text, heading):
    """The table rows (cells) under ``### heading``."""
    block = text.split(f"### {heading}\n", 1)[1].split("\n### ", 1)[0]
    lines = [ln for ln in block.splitlines() if ln.startswith("| ")][1:]  # past the titles
    return [[cell.strip() for cell in ln.strip("|").split("|")] for ln in lines]


def test_one_row_per_case_with_ratio_and_percent(tmp_path):
    path = _results(
        tmp_path,
        "a",
        gpu=H100,
        date="2026-12-06T11:00:00+00:00",
        cases=[
            _case("distmoe", iter_ms=2.0),
            _case("torch", iter_ms=3.2),
            _case(
                "distmoe",
                shape="fine",
                tokens=4096,
                hidden=2048,
                ffn=768,
                num_experts=128,
                routing="sampled",
                iter_ms=1.0,
            ),
            _case(
                "torch",
                shape="fine",
                tokens=4096,
                hidden=2048,
                ffn=768,
                num_experts=128,
                routing="sampled",
                iter_ms=2.5,
            ),
        ],
    )
    text = report.markdown_tables([path])
    rows = _rows(text, H100)
    # legacy names shown by their current ones; ratio = torch / distmoe; % dense (sustained)
    assert rows == [
        [
            "`dense-e32`",
            "8192, 4096, 2048, 32, 8",
            "1",
            "fwd+bwd",
            "exact",
            "2.000",
            "3.200",
            "1.60x",
            "500",
            "70 (82)",
            "[1]",
        ],
        [
            "`qwen3-30b-a3b`",
            "4096, 2048, 768, 128, 8",
            "1",
            "fwd+bwd",
            "sampled",
            "1.000",
            "2.500",
            "2.50x",
            "500",
            "70 (82)",
            "[1]",
        ],
    ]
    assert "CUDA-graph replay, median of 5 windows of 30 iterations" in text
    assert "2026-12-06T11:00:00+00:00, git 0123456" in text
    assert "`python -m distmoe bench --mode fwdbwd`" in text  # interpreter path shortened
    assert str(path.as_posix()) in text


def test_newest_file_wins_per_case_and_devices_stay_apart(tmp_path):
    old = _results(
        tmp_path,
        "old",
        gpu=H100,
        date="2026-12-05T10:00:00+00:00",
        cases=[
            _case("distmoe", iter_ms=4.0),
            _case("torch", iter_ms=6.0),
            _case("distmoe", mode="fwd", iter_ms=1.0),
            _case("torch", mode="fwd", iter_ms=1.5),
        ],
    )
    new = _results(
        tmp_path,
        "new",
        gpu=H100,
        date="2026-12-06T10:00:00+00:00",
        cases=[
            _case("distmoe", iter_ms=2.0),
            _case("torch", iter_ms=5.0),
        ],
    )
    other = _results(
        tmp_path,
        "h200",
        gpu=H200,
        date="2026-12-04T10:00:00+00:00",
        cases=[
            _case("distmoe", iter_ms=1.5),
            _case("torch", iter_ms=3.0),
        ],
    )
    text = report.markdown_tables([new, other, old])  # order of the arguments does not matter
    h100 = _rows(text, H100)
    # forward first; the fwd+bwd case from the newer file, its footnote numbered by first use
    assert [(r[3], r[5], r[6], r[7], r[10]) for r in h100] == [
        ("forward", "1.000", "1.500", "1.50x", "[1]"),
        ("fwd+bwd", "2.000", "5.000", "2.50x", "[2]"),
    ]
    assert text.index(f"[1] `{old.as_posix()}`") < text.index(f"[2] `{new.as_posix()}`")
    assert [(r[5], r[7]) for r in _rows(text, H200)] == [("1.500", "2.00x")]
    assert text.index(f"### {H100}") < text.index(f"### {H200}")


def test_failed_case_and_missing_baseline_show_dashes(tmp_path):
    path = _results(
        tmp_path,
        "a",
        gpu=H100,
        date="2026-12-06T10:00:00+00:00",
        cases=[
            _case("distmoe", status="error", iter_ms=None, note="RuntimeError: boom"),
            _case("torch", iter_ms=3.0),
            _case("distmoe", mode="fwd", imbalance=2.0, iter_ms=1.0),  # no torch case
        ],
    )
    rows = _rows(report.markdown_tables([path]), H100)
    assert [(r[3], r[4], r[5], r[6], r[7], r[9]) for r in rows] == [
        ("forward", "exact, 2x hot group", "1.000", "-", "-", "70 (82)"),
        ("fwd+bwd", "exact", "-", "3.000", "-", "-"),
    ]


def test_bad_files_raise_value_error_naming_them(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError, match="nope.json: cannot read it"):
        report.markdown_tables([missing])
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{")
    with pytest.raises(ValueError, match="garbage.json: not valid JSON"):
        report.markdown_tables([garbage])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="other.json: expected the bench's results.json"):
        report.markdown_tables([other])
    with pytest.raises(ValueError, match="results_paths is empty"):
        report.markdown_tables([])
    with pytest.raises(TypeError, match="a single path"):
        report.markdown_tables(str(missing))


def test_command_line_prints_the_tables(tmp_path, capsys):
    path = _results(
        tmp_path,
        "a",
        gpu=H100,
        date="2026-12-06T10:00:00+00:00",
        cases=[_case("distmoe"), _case("torch", iter_ms=3.0)],
    )
    assert report.main(["--markdown", str(path)]) == 0
    assert capsys.readouterr().out == report.markdown_tables([path])
    assert report.main(["--markdown", str(tmp_path / "missing.json")]) == 2
    assert "missing.json: cannot read it" in capsys.readouterr().err
