"""The docs' benchmark tables, built from the figures in ``bench/results/``.

A figure typed into a doc drifts from the run that measured it, and a doc that keeps every run
becomes a diary. So each table of docs/benchmarks.md and docs/gpu_smoke.md is rendered from one
JSON file, the bench's latest figures with their command, machine and date, and ``--check`` fails
where a doc's copy differs (``tests/unit/test_bench_tables.py`` runs it): a figure changes in the
data, and the doc is regenerated from it, never edited by hand.

    .venv/bin/python -m bench.tables            # rewrite every marked table of the docs
    .venv/bin/python -m bench.tables --check    # exit 1, with a diff, where a doc's table differs

A figure gets into the docs in two commands: run the bench behind the table with ``--write NAME``
(``python bench/bench_step.py --only galore --repeats 8 --write step_galore``), which writes ``bench/results/NAME.json``
through :func:`bench.record.write_table` (the command, commit, machine and date of that run, the rows
checked against this module's rendering first), then ``python -m bench.tables``. Nobody types a
figure or its provenance into the data: a table whose rows come from several runs is the exception,
merged from the benches' own files.

A doc marks a table with ``<!-- table: NAME -->`` and ``<!-- /table -->`` on lines of their own;
everything between them is generated from ``bench/results/NAME.json``::

    {"command": "python bench/x.py --flag",      # or a list of commands, or null: not recorded
     "commit": "<short hash>",                    # data only: the docs hold no commit hashes
     "machine": "...", "date": "YYYY-MM-DD",      # either may be null or absent
     "columns": [{"key": "optimizer", "label": "optimizer"},
                 {"key": "median_ms", "label": "median step (ms)", "decimals": 1},
                 {"key": "ratio", "label": "step / AdamW", "decimals": 2, "suffix": "x"}],
     "rows": [{"optimizer": "torch AdamW (foreach)", "median_ms": 100.7, "ratio": 1.0}, ...],
     "notes": ["sentences printed after the provenance, above the table", ...]}

A column with ``decimals`` holds numbers, printed with that many decimals and right-aligned
(``"format": "e"`` prints ``1.8e-4``; ``"thousands": true`` prints ``3,984``; ``suffix`` follows the
number). A cell is a number, a string (printed as it is), null (empty), a list (one figure per run,
joined by commas), ``{"min": a, "max": b}`` (a range, ``a-b``) or ``{"value": v, ...}`` (``v`` with
the column's format overridden for this cell, e.g. ``"decimals": 0``). A row may also carry
``commit``, ``command``, ``date`` and ``note``, which stay in the data. Every bench writes this
format (:mod:`bench.record`), also the ones whose files no doc renders; a file without ``columns``
is one written before that, not a table.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOCS = (ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "gpu_smoke.md")

# Markers on lines of their own, so that a doc can name the syntax in its prose.
OPEN = re.compile(r"^<!-- table: (?P<name>[\w.-]+) -->\n", re.M)
BLOCK = re.compile(
    r"^(?P<open><!-- table: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)^(?P<close><!-- /table -->)$", re.S | re.M
)
# Row keys that are data about the row rather than a column: kept in the file, never rendered.
ROW_DATA = frozenset({"commit", "command", "date", "note"})

Loader = Callable[[str], Mapping[str, Any]]


def number(value: float, spec: Mapping[str, Any]) -> str:
    """``value`` with the decimals, notation and grouping ``spec`` states: a stored figure is
    printed exactly as precise as it was measured, never more."""
    decimals = spec.get("decimals")
    if not isinstance(decimals, int):
        raise ValueError(f"column {spec.get('key')!r}: a number needs the column's (or the cell's) 'decimals'")
    if spec.get("format", "f") == "e":
        mantissa, exponent = f"{value:.{decimals}e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    grouping = "," if spec.get("thousands") else ""
    return f"{value:{grouping}.{decimals}f}"


def cell(value: Any, spec: Mapping[str, Any]) -> str:
    """One table cell: see the module's docstring for the forms a value takes."""
    if value is None:
        return ""
    if isinstance(value, bool):
        raise TypeError(f"column {spec.get('key')!r}: a boolean is not a figure ({value!r})")
    if isinstance(value, str):
        return value.replace("|", "\\|")
    suffix = spec.get("suffix", "")
    if isinstance(value, (int, float)):
        return number(value, spec) + suffix
    if isinstance(value, list):
        return ", ".join(cell(v, spec) for v in value)
    if isinstance(value, dict):
        override = {**spec, **{k: v for k, v in value.items() if k not in ("value", "min", "max")}}
        if "value" in value:
            return cell(value["value"], override)
        if "min" in value and "max" in value:
            return f"{number(value['min'], override)}-{number(value['max'], override)}{override.get('suffix', '')}"
    raise TypeError(f"column {spec.get('key')!r}: cannot render {value!r}")


def provenance(data: Mapping[str, Any]) -> str:
    """The paragraph above a table: the command that printed it, the machine, the date and the
    notes, so that a figure is never read without its conditions (the commit stays in the data)."""
    command = data.get("command")
    if command is None:
        parts = ["Command: not recorded."]
    elif isinstance(command, str):
        parts = [f"Command: `{command}`."]
    else:
        parts = ["Commands: " + "; ".join(f"`{c}`" for c in command) + "."]
    for key, label in (("machine", "Machine"), ("date", "Date")):
        if data.get(key):
            parts.append(f"{label}: {str(data[key]).rstrip('.')}.")
    return " ".join(parts + list(data.get("notes") or ()))


def _row(values: Sequence[str]) -> str:
    return "|" + "|".join(f" {v} " if v else " " for v in values) + "|"


def render(data: Mapping[str, Any], name: str = "table") -> str:
    """The markdown that goes between a table's markers: its provenance paragraph, then the table."""
    columns = data.get("columns")
    if not columns:
        raise ValueError(f"{name}: no 'columns' (a bench's own result format is not a doc table)")
    keys = {c["key"] for c in columns}
    lines = [provenance(data), "", _row([c["label"] for c in columns])]
    lines.append("|" + "|".join("---:" if "decimals" in c else "---" for c in columns) + "|")
    for i, row in enumerate(data["rows"]):
        stray = set(row) - keys - ROW_DATA
        if stray:
            raise ValueError(f"{name}: row {i} has keys that are no column: {sorted(stray)}")
        try:
            lines.append(_row([cell(row.get(c["key"]), c) for c in columns]))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}: row {i}: {e}") from e
    return "\n".join(lines) + "\n"


def load_from(results: Path) -> Loader:
    """A loader of ``results/NAME.json``, naming the doc's marker when the file is missing."""

    def load(name: str) -> Mapping[str, Any]:
        path = results / f"{name}.json"
        if not path.exists():
            raise FileNotFoundError(f"<!-- table: {name} --> has no data file {path}")
        with open(path) as f:
            return json.load(f)

    return load


def rebuild(text: str, load: Loader) -> str:
    """``text`` with every marked table regenerated; refuses a marker without its closing one."""
    if len(OPEN.findall(text)) != len(BLOCK.findall(text)):
        raise ValueError("a '<!-- table: NAME -->' marker without its '<!-- /table -->' (or nested markers)")
    return BLOCK.sub(lambda m: m["open"] + render(load(m["name"]), m["name"]) + m["close"], text)


def stale(docs: Sequence[Path] = DOCS, results: Path = RESULTS) -> list[str]:
    """One message (with a diff) per doc whose tables differ from what the data renders."""
    load = load_from(results)
    messages = []
    for doc in docs:
        text = doc.read_text()
        built = rebuild(text, load)
        if built != text:
            diff = difflib.unified_diff(
                text.splitlines(), built.splitlines(), str(doc), "rendered from data", lineterm=""
            )
            messages.append("\n".join(diff))
    return messages


def main(argv: list[str] | None = None) -> int:
    """Rewrite the docs' tables from the data, or with ``--check`` report those that differ."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 where a doc's table differs")
    ap.add_argument("--docs", nargs="+", type=Path, default=list(DOCS))
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.check:
        messages = stale(args.docs, args.results)
        for m in messages:
            print(m)
        if messages:
            print("\nregenerate: .venv/bin/python -m bench.tables", file=sys.stderr)
        return 1 if messages else 0
    load = load_from(args.results)
    for doc in args.docs:
        text = doc.read_text()
        built = rebuild(text, load)
        if built != text:
            doc.write_text(built)
            print(f"rewrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
