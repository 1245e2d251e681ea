"""bench/tables.py: the docs' benchmark tables are what their data in bench/results/ renders, so a
table edited by hand, or a data file changed without ``python -m bench.tables``, fails here; and the
renderer and the marker rewriting on tiny samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import tables

SAMPLE = {
    "command": "python bench/x.py --fast",
    "commit": "abc1234",
    "machine": "a 2-core CPU",
    "date": "2026-01-02",
    "notes": ["Medians."],
    "columns": [
        {"key": "name", "label": "optimizer"},
        {"key": "ms", "label": "step (ms)", "decimals": 1},
        {"key": "ratio", "label": "/ AdamW", "decimals": 2, "suffix": "x"},
    ],
    "rows": [
        {"name": "AdamW", "ms": 100.0, "ratio": 1.0, "commit": "def5678"},
        {"name": "ours", "ms": {"min": 50, "max": 61.25}, "ratio": [0.5, 0.61]},
        {"name": "a|b", "ms": None, "ratio": {"value": 3, "decimals": 0}},
    ],
}

RENDERED = """Command: `python bench/x.py --fast`. Machine: a 2-core CPU. Date: 2026-01-02. Medians.

| optimizer | step (ms) | / AdamW |
|---|---:|---:|
| AdamW | 100.0 | 1.00x |
| ours | 50.0-61.2 | 0.50x, 0.61x |
| a\\|b | | 3x |
"""


def test_docs_tables_are_built_from_the_data() -> None:
    """Every marked table of docs/benchmarks.md and docs/gpu_smoke.md equals its data's rendering."""
    stale = tables.stale()
    assert stale == [], "regenerate with .venv/bin/python -m bench.tables:\n" + "\n".join(stale)


def test_each_doc_has_tables_and_no_commit_hash() -> None:
    """The docs hold their tables (a page that lost its markers would pass the check vacuously), and
    the rendering keeps commits in the data."""
    for doc in tables.DOCS:
        text = doc.read_text()
        assert tables.BLOCK.search(text), f"{doc} has no <!-- table: NAME --> block"
    assert "abc1234" not in tables.render(SAMPLE) and "def5678" not in tables.render(SAMPLE)


def test_render_sample() -> None:
    assert tables.render(SAMPLE, "sample") == RENDERED


@pytest.mark.parametrize(
    ("value", "spec", "text"),
    [
        (1.8e-4, {"decimals": 1, "format": "e"}, "1.8e-4"),
        (3984, {"decimals": 0, "thousands": True}, "3,984"),
        ({"min": 9.0, "max": 9.6, "decimals": 1, "suffix": " s"}, {"decimals": 0, "suffix": " ms"}, "9.0-9.6 s"),
        ({"value": 0.58, "suffix": "x"}, {"decimals": 2}, "0.58x"),
        ("fails to build", {"decimals": 1}, "fails to build"),
    ],
)
def test_cell_forms(value: object, spec: dict, text: str) -> None:
    assert tables.cell(value, spec) == text


def test_refuses_what_it_cannot_render_faithfully() -> None:
    """A number without decimals, a row key that is no column, or a bench's own format without
    columns is an error naming the table, not a guessed rendering."""
    with pytest.raises(ValueError, match="decimals"):
        tables.render({"columns": [{"key": "a", "label": "a"}], "rows": [{"a": 1.5}]}, "t")
    with pytest.raises(ValueError, match="no column"):
        tables.render({"columns": [{"key": "a", "label": "a"}], "rows": [{"a": "x", "typo": 1}]}, "t")
    with pytest.raises(ValueError, match="columns"):
        tables.render({"rows": [{"seq": 256}]}, "qk")


def _workspace(tmp_path: Path) -> tuple[Path, Path]:
    results = tmp_path / "results"
    results.mkdir()
    (results / "sample.json").write_text(json.dumps(SAMPLE))
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n\nSee `<!-- table: NAME -->` markers.\n\n<!-- table: sample -->\nold\n<!-- /table -->\n\nEnd.\n"
    )
    return doc, results


def test_rewrite_then_check(tmp_path: Path) -> None:
    """The rewrite replaces only the marked block (a marker quoted in prose stays prose); the check
    then passes, and fails naming the figure once the doc's table is edited by hand."""
    doc, results = _workspace(tmp_path)
    assert tables.main(["--check", "--docs", str(doc), "--results", str(results)]) == 1
    assert tables.main(["--docs", str(doc), "--results", str(results)]) == 0
    text = doc.read_text()
    assert text == (
        "# Doc\n\nSee `<!-- table: NAME -->` markers.\n\n<!-- table: sample -->\n"
        + RENDERED
        + "<!-- /table -->\n\nEnd.\n"
    )
    assert tables.stale([doc], results) == []
    doc.write_text(text.replace("| 100.0 |", "| 99.0 |"))
    (message,) = tables.stale([doc], results)
    assert "-| AdamW | 99.0 | 1.00x |" in message and "+| AdamW | 100.0 | 1.00x |" in message


def test_marker_without_its_end_or_data(tmp_path: Path) -> None:
    doc, results = _workspace(tmp_path)
    doc.write_text("<!-- table: sample -->\nno end\n")
    with pytest.raises(ValueError, match="without its"):
        tables.stale([doc], results)
    doc.write_text("<!-- table: missing -->\n<!-- /table -->\n")
    with pytest.raises(FileNotFoundError, match="missing"):
        tables.stale([doc], results)
