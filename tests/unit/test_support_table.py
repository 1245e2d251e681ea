"""The README's support table built from a run's outcomes (tests/helpers/support.py): the JUnit parser,
the session recorder the conftest check uses, the table builder and the README check, on small
synthetic runs and reports. The check of the README against a whole run happens at the end of
that run (tests/conftest.py); regenerate: make test, then python -m tests.helpers.support --junit runs/junit.xml.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from xml.sax.saxutils import quoteattr

from tests.helpers import support
from tests.helpers.support import FAILED, PASSED, SKIPPED, Outcome

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SYNTHETIC_TESTS = """
import pytest

@pytest.fixture
def bad_setup():
    raise RuntimeError("setup broke")

@pytest.fixture
def bad_teardown():
    yield
    raise RuntimeError("teardown broke")

def test_pass(): pass
def test_fail(): assert 1 == 2, "one is not two"
def test_skip(): pytest.skip("no GPU here")
@pytest.mark.skipif(True, reason="marked skip")
def test_skipif(): pass
@pytest.mark.xfail(reason="known bug")
def test_xfail(): assert False
def test_setup_error(bad_setup): pass
def test_fail_then_teardown_error(bad_teardown): assert False, "call broke"
@pytest.mark.parametrize("x", [1, 2], ids=["a/b", "c::d"])
def test_param(x): pass
class TestK:
    def test_m(self): pass
"""

RECORDING_CONFTEST = """
import json, os
from tests.helpers.support import OutcomeRecorder
REC = OutcomeRecorder()
def pytest_runtest_logreport(report):
    REC.add(report)
def pytest_sessionfinish(session):
    with open(os.environ["RECORDED"], "w") as f:
        json.dump({k: [o.status, o.message] for k, o in REC.outcomes.items()}, f)
"""


def _pytest(args: list[str], cwd: str, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, PYTHONPATH=ROOT, **env)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True, timeout=300)


def test_recorder_and_junit_report_agree(tmp_path) -> None:
    """A session's recorded outcomes (what the conftest check uses) are what its JUnit report says
    (what `python -m tests.helpers.support --junit` reads), for every kind of outcome."""
    (tmp_path / "test_synth.py").write_text(SYNTHETIC_TESTS)
    (tmp_path / "conftest.py").write_text(RECORDING_CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    xml, recorded = tmp_path / "junit.xml", tmp_path / "recorded.json"
    proc = _pytest(["-q", f"--junitxml={xml}", "test_synth.py"], str(tmp_path), RECORDED=str(recorded))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    from_report = {k: (o.status, o.message) for k, o in support.read_junit(str(xml)).items()}
    from_session = {k: tuple(v) for k, v in json.loads(recorded.read_text()).items()}
    assert from_session == from_report
    assert from_report == {
        "test_synth::test_pass": (PASSED, ""),
        "test_synth::test_fail": (FAILED, "AssertionError: one is not two"),
        "test_synth::test_skip": (SKIPPED, "no GPU here"),
        "test_synth::test_skipif": (SKIPPED, "marked skip"),
        "test_synth::test_xfail": (SKIPPED, "xfail: known bug"),
        "test_synth::test_setup_error": ("error", "RuntimeError: setup broke"),
        # a failed call, then a failed teardown: the worst report counts
        "test_synth::test_fail_then_teardown_error": ("error", "RuntimeError: teardown broke"),
        "test_synth::test_param[a/b]": (PASSED, ""),
        "test_synth::test_param[c::d]": (PASSED, ""),
        "test_synth.TestK::test_m": (PASSED, ""),
    }


def _junit(outcomes: dict[str, Outcome]) -> str:
    """A JUnit report as pytest writes it, for the given outcomes."""
    cases = []
    for key, outcome in outcomes.items():
        classname, name = key.split("::", 1)
        tag = {PASSED: "", SKIPPED: "skipped", FAILED: "failure", "error": "error"}[outcome.status]
        child = f"<{tag} message={quoteattr(outcome.message)}>details</{tag}>" if tag else ""
        cases.append(f"<testcase classname={quoteattr(classname)} name={quoteattr(name)}>{child}</testcase>")
    return f'<testsuites><testsuite name="pytest">{"".join(cases)}</testsuite></testsuites>'


def _rows(table: str) -> dict[str, dict[str, str]]:
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header[1:], cells[1:]))
    return rows


def test_table_from_a_report_with_a_skipped_a_failed_and_a_missing_test(tmp_path) -> None:
    cells = support.cells()
    rows = list(cells)
    skipped_row, failed_row, missing_row = rows[0], rows[1], rows[2]
    ddp = support.headers()[-2]
    outcomes = {key: Outcome(PASSED) for key in support.required_tests()}
    outcomes[cells[skipped_row][ddp][0]] = Outcome(SKIPPED, "needs 2 GPUs")
    outcomes[cells[failed_row][support.PARITY_HEADER][-1]] = Outcome(FAILED, "AssertionError: parity")
    del outcomes[cells[missing_row][support.CHECKPOINT_HEADER][0]]
    report = tmp_path / "junit.xml"
    report.write_text(_junit(outcomes))

    assert support.read_junit(str(report)) == outcomes
    table = support.markdown(support.read_junit(str(report)))
    got = _rows(table)
    assert list(got) == rows and all(list(r) == support.headers() for r in got.values())
    expected = {row: {h: "✔" if cells[row][h] else support.NOT_APPLICABLE for h in support.headers()} for row in rows}
    expected[skipped_row][ddp] = "⊘"
    expected[failed_row][support.PARITY_HEADER] = "✘"
    expected[missing_row][support.CHECKPOINT_HEADER] = "—"  # not every test behind it ran
    assert got == expected
    notes = table.split("\n\n", 1)[1].splitlines()
    refused = [f"- n/a {row}, {h}: refused at boost" for row in rows for h in support.headers() if not cells[row][h]]
    assert [n.split(": refused at boost")[0] + ": refused at boost" if "refused" in n else n for n in notes] == [
        f"- ⊘ {skipped_row}, {ddp}: skipped: needs 2 GPUs",
        f"- ✘ {failed_row}, parity grid: {cells[failed_row][support.PARITY_HEADER][-1]}: AssertionError: parity",
        *refused,
    ]
    # no outcome at all: nothing ran
    assert set(_rows(support.markdown({}))[rows[0]].values()) == {"—"}


def test_readme_check_fails_only_a_complete_run_that_disagrees() -> None:
    passed = {key: Outcome(PASSED) for key in support.required_tests()}
    readme = "# title\n\nSome text.\n\n" + support.markdown(passed) + "\n\nMore text.\n"
    assert support.check_readme(passed, readme) is None

    row = next(iter(support.cells()))
    one_failed = dict(passed)
    one_failed[support.cells()[row][support.PARITY_HEADER][0]] = Outcome(FAILED, "AssertionError")
    problem = support.check_readme(one_failed, readme)
    assert problem is not None and "differs from the outcomes of this run" in problem
    assert f"\n-| {row} | ✔ |" in problem and f"\n+| {row} | ✘ |" in problem
    assert f"\n+- ✘ {row}, parity grid: " in problem

    # a partial run (one booster test missing, or only other files' tests) is not checked
    partial = dict(one_failed)
    partial.pop(next(iter(support.cells()[row][support.headers()[1]])))
    assert support.check_readme(partial, readme) is None
    assert support.check_readme({"tests.unit.test_lamb::test_x": Outcome(FAILED)}, readme) is None
    # a README without the table fails a complete run
    assert support.check_readme(passed, "# title\n") is not None


def test_cli_prints_the_table_of_a_report(tmp_path, capsys) -> None:
    passed = {key: Outcome(PASSED) for key in support.required_tests()}
    report = tmp_path / "junit.xml"
    report.write_text(_junit(passed))
    assert support.main(["--junit", str(report)]) == 0
    assert capsys.readouterr().out == support.markdown(passed) + "\n"


def test_every_test_backing_the_table_exists(tmp_path) -> None:
    """The keys derived from the configurations are the collected tests' ids (else a complete run
    would never be recognised as complete and the README never checked), and every collected
    parametrization of the table's test functions backs a cell."""
    files = [m.replace(".", "/") + ".py" for m in support.TABLE_MODULES]
    proc = _pytest(["--collect-only", "-q", *files], ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    collected = {support.report_key(line) for line in proc.stdout.splitlines() if "::" in line}
    required = support.required_tests()
    assert required <= collected, sorted(required - collected)[:5]
    functions = {key.split("[")[0] for key in required}
    assert {key for key in collected if key.split("[")[0] in functions} == required
    assert len(functions) == 5, functions


def test_readme_documents_the_marks() -> None:
    with open(support.README) as f:
        text = f.read()
    table = support.readme_table(text)
    assert table is not None and table.splitlines()[0] == support.markdown({}).splitlines()[0]
    assert "python -m tests.helpers.support --junit runs/junit.xml" in text
    assert all(mark in text for mark in ("✔", "✘", "⊘", "—"))
