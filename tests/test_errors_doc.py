"""docs/errors.md is the catalogue the source generates (distmoe.tools.errors): a changed or
new error message shows up as a failure here until the doc is regenerated."""

from pathlib import Path

from distmoe.tools.errors import MODULES, catalogue, raises

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"


def test_errors_doc_is_current():
    assert DOC.read_text() == catalogue(), (
        "docs/errors.md is out of date: python -m distmoe.tools.errors > docs/errors.md")


def test_catalogue_reads_the_raises():
    rows = {m: raises(m) for m in MODULES}
    # a known error of each kind of entry point, found where it is raised
    assert ("MoEContext.__init__", "TypeError",
            "cfg must be a distmoe.MoEConfig, got {type(cfg).__name__}") in rows[
        "distmoe.ops.context"]
    assert any(kind == "ValueError" and where == "check_call"
               for where, kind, _ in rows["distmoe.ops.validation"])
    assert sum(len(r) for r in rows.values()) >= 150
