"""The README's support table, built from the outcomes of a test run.

Each cell of the table is backed by a set of tests, derived from the same configurations the tests
are parametrized with (``tests/helpers/cases.py``: ``FAMILIES``, from which ``tests/distributed/test_booster.py``
``CASES`` and ``tests/distributed/test_checkpoint.py`` ``OPTIMIZERS`` derive, and ``PARITY_CASES``), so adding
an optimizer there adds its row. A cell shows what those tests did in one run:

* ✔ every test backing the cell passed;
* ✘ one of them failed or errored;
* ⊘ one of them was skipped (or xfailed) and none failed: the reasons are listed under the table;
* — no test backs the cell, or not every test backing it ran.

``python -m tests.helpers.support --junit runs/junit.xml`` prints the table of a JUnit report (pytest
``--junitxml``; ``make test`` writes that one). A pytest run that executed every test backing the
table (``make test``) builds it from its own outcomes at the end and fails if the README's copy
differs (``tests/conftest.py``); a partial run (one file, ``-k``, ``-m``) is not checked.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")

# Booster layouts, in the order of the table's columns: (plugin, tp, pp, ZeRO stage, precision)
# and, for sequence parallelism, a sixth entry: the SP mode. "all_to_all" runs on its own sp=2
# axis, and ZeRO then shards over dp x sp (not over the dp group ColossalAI hands to
# setup_distributed); "split_gather" splits the sequence over the TP group. A sixth entry
# OFFLOAD instead: ZeRO's ``cpu_offload=True`` (masters and optimizer states in host memory).
COLUMNS: list[tuple] = [
    ("HybridParallelPlugin", 2, 1, 0, "fp32"),
    ("HybridParallelPlugin", 2, 1, 0, "bf16"),
    ("HybridParallelPlugin", 2, 1, 1, "bf16"),
    ("HybridParallelPlugin", 2, 1, 2, "bf16"),
    ("HybridParallelPlugin", 2, 1, 1, "fp16"),
    ("HybridParallelPlugin", 2, 2, 0, "fp32"),
    ("HybridParallelPlugin", 1, 2, 1, "bf16"),
    ("HybridParallelPlugin", 1, 1, 1, "bf16", "all_to_all"),
    ("HybridParallelPlugin", 2, 1, 1, "bf16", "split_gather"),
    ("HybridParallelPlugin", 2, 1, 1, "bf16", "cpu_offload"),
    # A tiny Mixtral, experts split over ep=2 and ZeRO-sharded over the MoE data-parallel group.
    ("MoeHybridParallelPlugin", 1, 1, 1, "bf16"),
    ("LowLevelZeroPlugin", 1, 1, 1, "bf16"),
    ("LowLevelZeroPlugin", 1, 1, 2, "fp32"),
    ("LowLevelZeroPlugin", 1, 1, 2, "fp32", "cpu_offload"),
    ("TorchDDPPlugin", 1, 1, 0, "fp32"),
    # FSDP's full shard over 4 ranks (the fourth entry: ZeRO-3): one flat parameter for the whole
    # model, cut into 4 ranges, so most parameters are split anywhere or absent on a rank.
    ("TorchFSDPPlugin", 1, 1, 3, "fp32"),
    # Gemini's static placement without offload over 4 ranks (ZeRO-3), chunks small enough that the
    # tiny Llama spans several, each cut into 4 shards: parameters split anywhere or absent on a rank.
    ("GeminiPlugin", 1, 1, 3, "bf16"),
]

#: The sixth entry of a column with ZeRO's CPU offload.
OFFLOAD = "cpu_offload"

PARITY_HEADER = "parity grid"
CHECKPOINT_HEADER = "checkpoint resume / reshard"

PASSED, FAILED, ERROR, SKIPPED = "passed", "failed", "error", "skipped"
MARKS = {PASSED: "✔", FAILED: "✘", ERROR: "✘", SKIPPED: "⊘"}
NOT_RUN = "—"
#: A cell an optimizer refuses at boost by design (tests/distributed/test_booster.py ``EXCLUDED``);
#: the notes under the table give the reason.
NOT_APPLICABLE = "n/a"
# When one test has several reports (a failing teardown after a passed call), the worst counts.
_SEVERITY = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3}

# The modules whose tests back the table: a run that touched none of them is not checked.
TABLE_MODULES = ("tests.distributed.test_booster", "tests.distributed.test_parity", "tests.distributed.test_checkpoint")


@dataclass(frozen=True)
class Outcome:
    """What one test did in a run; ``message`` is the skip reason or the failure's summary."""

    status: str
    message: str = ""


def merge(old: Outcome | None, new: Outcome) -> Outcome:
    """The outcome of a test with several reports (setup, call, teardown): the worst one."""
    if old is None or _SEVERITY[new.status] > _SEVERITY[old.status]:
        return new
    return old


def report_key(nodeid: str) -> str:
    """``tests/test_x.py::Class::test[id]`` -> ``tests.test_x.Class::test[id]``: the form a JUnit
    report names a test by (its ``classname`` and ``name`` attributes), so that outcomes recorded
    in a pytest session and outcomes read from a report share their keys."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]) + "::" + names[-1]


def read_junit(source: str) -> dict[str, Outcome]:
    """Outcomes by test key from a JUnit XML report written by pytest ``--junitxml``.

    ``source`` is a path or the XML text itself. A ``<failure>`` is a failed test, an ``<error>``
    one that errored in setup or teardown, a ``<skipped>`` a skipped or xfailed test (its
    ``message`` is the reason), a testcase with none of them a passed one.
    """
    root = ET.fromstring(source) if source.lstrip().startswith("<") else ET.parse(source).getroot()
    outcomes: dict[str, Outcome] = {}
    for case in root.iter("testcase"):
        key = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = Outcome(PASSED)
        for tag, status in (("skipped", SKIPPED), ("failure", FAILED), ("error", ERROR)):
            for child in case.findall(tag):
                outcome = merge(outcome, Outcome(status, _junit_message(child)))
        outcomes[key] = merge(outcomes.get(key), outcome)
    return outcomes


def _junit_message(child: ET.Element) -> str:
    """The reason as OutcomeRecorder words it: the first line of the message, without pytest's
    'failed on setup with "..."' wrapper of errors, and an xfail's reason prefixed by "xfail"."""
    message = child.get("message") or ""
    wrapped = re.fullmatch(r'failed on \w+ with "(.*)"', message, flags=re.S)
    if wrapped:
        message = wrapped.group(1)
    if child.get("type") == "pytest.xfail":
        return f"xfail: {message}".rstrip(": ")
    return message.splitlines()[0] if message else ""


class OutcomeRecorder:
    """Collects the outcomes of a pytest session by test key, classified as pytest's JUnit report
    classifies them (``tests/unit/test_support_table.py`` checks that the two agree)."""

    def __init__(self) -> None:
        self.outcomes: dict[str, Outcome] = {}

    def add(self, report: Any) -> None:
        """Record one ``pytest.TestReport`` (setup, call or teardown phase)."""
        if report.failed:
            outcome = Outcome(FAILED if report.when == "call" else ERROR, _failure_line(report))
        elif report.skipped:
            if hasattr(report, "wasxfail"):
                outcome = Outcome(SKIPPED, f"xfail: {report.wasxfail}".rstrip(": "))
            else:
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                outcome = Outcome(SKIPPED, reason.removeprefix("Skipped: "))
        elif report.when == "call":
            outcome = Outcome(PASSED)
        else:
            return
        key = report_key(report.nodeid)
        self.outcomes[key] = merge(self.outcomes.get(key), outcome)


def _failure_line(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    return crash.message.splitlines()[0] if crash is not None and crash.message else report.when


def _header(col: tuple) -> str:
    plugin, tp, pp, zero, precision, *extra = col
    sp = [e for e in extra if e != OFFLOAD]
    short = {
        "HybridParallelPlugin": "Hybrid",
        "MoeHybridParallelPlugin": "MoeHybrid ep=2",
        "LowLevelZeroPlugin": "LowLevelZero",
        "TorchDDPPlugin": "TorchDDP",
        "TorchFSDPPlugin": "TorchFSDP",
        "GeminiPlugin": "Gemini",
    }
    parts = [short[plugin]]
    if plugin == "HybridParallelPlugin":
        parts.append(f"tp={tp}")
        if pp > 1:
            parts.append(f"pp={pp}")
        if sp:
            parts.append(f"sp={2 if sp[0] == 'all_to_all' else tp} {sp[0]}")
    if plugin == "TorchFSDPPlugin":
        parts.append("full shard")
    elif plugin == "GeminiPlugin":
        parts.append("static")
    elif plugin != "TorchDDPPlugin":
        parts.append(f"ZeRO-{zero}")
    parts.append(precision)
    if OFFLOAD in extra:
        parts.append("CPU offload")
    return " ".join(parts)


def headers() -> list[str]:
    """The table's cell columns, in order (the first column, the optimizer, excluded)."""
    return [PARITY_HEADER] + [_header(c) for c in COLUMNS] + [CHECKPOINT_HEADER]


def cells() -> dict[str, dict[str, list[str]]]:
    """Row (optimizer) -> column header -> the keys of the tests backing that cell.

    Rows are named by tests/distributed/test_booster.py's ``SPECS``; a parity case maps to its ``row``, else
    to the first row whose spec expects its class, a checkpoint entry to the row of the same name
    (any case case-blind).
    A configuration that matches no row gets a row of its own, so it cannot go unreported.
    """
    from tests.distributed import test_booster, test_checkpoint
    from tests.helpers.cases import PARITY_CASES

    table: dict[str, dict[str, list[str]]] = {}

    def cell(row: str, column: str) -> list[str]:
        return table.setdefault(row, {h: [] for h in headers()})[column]

    for name in test_booster.SPECS:
        cell(name, PARITY_HEADER)
    by_class: dict[str, str] = {}
    for name, spec in test_booster.SPECS.items():
        by_class.setdefault(spec.expected_cls, name)  # a class's first row; a case may name another
    by_lower = {name.lower(): name for name in test_booster.SPECS}

    for case in PARITY_CASES:
        row = case.row or by_class.get(case.cls.__name__, case.cls.__name__.removeprefix("Distributed"))
        cell(row, PARITY_HEADER).append(f"tests.distributed.test_parity::test_parity_grid[{case.id}]")
    for param in test_booster.CASES:
        name, col = param.values
        cell(name, _header(col)).append(f"tests.distributed.test_booster::test_booster_parity[{param.id}]")
    for name in test_checkpoint.OPTIMIZERS:
        backing = cell(by_lower.get(name.lower(), name), CHECKPOINT_HEADER)
        for test, layouts in test_checkpoint.TABLE_TESTS.items():
            ids = [f"{layout.id}-{name}" for layout in layouts] if layouts else [name]
            backing += [f"tests.distributed.test_checkpoint::{test}[{i}]" for i in ids]
    return table


def required_tests() -> set[str]:
    """Every test key the table depends on."""
    return {key for row in cells().values() for keys in row.values() for key in keys}


def _cell_outcome(keys: list[str], outcomes: dict[str, Outcome]) -> tuple[str, str]:
    """(mark, note) of one cell; the note names the skipped or failed tests."""
    ran = {k: outcomes[k] for k in keys if k in outcomes}
    failed = {k: o for k, o in ran.items() if o.status in (FAILED, ERROR)}
    if failed:
        return MARKS[FAILED], "; ".join(f"{k}: {o.message}" for k, o in sorted(failed.items()))
    skipped = sorted({o.message for o in ran.values() if o.status == SKIPPED})
    if skipped:
        return MARKS[SKIPPED], "skipped: " + "; ".join(skipped)
    if not keys or len(ran) < len(keys):
        return NOT_RUN, ""
    return MARKS[PASSED], ""


def markdown(outcomes: dict[str, Outcome]) -> str:
    """The support table of a run, followed (after a blank line) by a list of the skipped and
    failed cells with their reasons when there are any."""
    from tests.distributed import test_booster

    hs = headers()
    lines = ["| " + " | ".join(["optimizer", *hs]) + " |", "|" + "---|" * (len(hs) + 1)]
    notes = []
    refused = {(name, _header(col)): why for (name, col), why in test_booster.EXCLUDED.items()}
    for row, columns in cells().items():
        marks = []
        for header in hs:
            mark, note = _cell_outcome(columns[header], outcomes)
            if not columns[header] and (row, header) in refused:
                mark, note = NOT_APPLICABLE, f"refused at boost: {refused[row, header]}"
            marks.append(mark)
            if note:
                notes.append(f"- {mark} {row}, {header}: {note}")
        lines.append("| " + " | ".join([row, *marks]) + " |")
    return "\n".join(lines + ([""] + notes if notes else []))


def readme_table(text: str) -> str | None:
    """The README's copy of the table (with its notes), or None when it has none."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("| optimizer | parity grid |")), None)
    if start is None:
        return None
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    notes = end + 1
    while notes < len(lines) and lines[notes].startswith(("- ✘", "- ⊘", f"- {NOT_APPLICABLE}")):
        notes += 1
    if notes > end + 1 and lines[end] == "":
        end = notes
    return "\n".join(lines[start:end])


def touches_table(outcomes: dict[str, Outcome]) -> bool:
    """Whether a run recorded any test of the modules backing the table (cheap: no imports)."""
    return any(key.split("::")[0] in TABLE_MODULES for key in outcomes)


def check_readme(outcomes: dict[str, Outcome], readme_text: str) -> str | None:
    """None when the run did not execute every test backing the table (a partial run) or when the
    README's table equals the one built from ``outcomes``; otherwise the problem and a diff."""
    if not touches_table(outcomes) or not required_tests() <= outcomes.keys():
        return None
    built = markdown(outcomes)
    current = readme_table(readme_text)
    if current == built:
        return None
    diff = difflib.unified_diff(
        (current or "").splitlines(), built.splitlines(), "README.md", "this run's outcomes", lineterm=""
    )
    return (
        "README.md's support table differs from the outcomes of this run (every test backing it ran).\n"
        "Fix the failing tests, or regenerate it: make test, then "
        "python -m tests.helpers.support --junit runs/junit.xml\n" + "\n".join(diff)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.helpers.support", description=__doc__.splitlines()[0])
    ap.add_argument("--junit", required=True, help="JUnit XML report of a pytest run (make test: runs/junit.xml)")
    ap.add_argument("--check", action="store_true", help="exit 1 (printing a diff) if README.md's copy differs")
    args = ap.parse_args(argv)
    outcomes = read_junit(args.junit)
    if args.check:
        with open(README) as f:
            text = f.read()
        missing = required_tests() - outcomes.keys()
        if missing:
            print(f"{args.junit} lacks {len(missing)} tests backing the table, e.g. {sorted(missing)[0]}")
            return 1
        problem = check_readme(outcomes, text)
        if problem:
            print(problem)
            return 1
        print("README.md's support table matches", args.junit)
        return 0
    print(markdown(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
