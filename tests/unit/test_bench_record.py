"""bench/record.py: a bench writes its own results as table data (command, commit, machine, date,
rows) that bench/tables.py renders, refuses a row the docs could not show, and replaces the file
atomically; and the benches' ``--write`` paths, on tiny real runs into a temporary results
directory (never bench/results)."""

from __future__ import annotations

import datetime
import json
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import record, tables

COLUMNS = [record.col("name", "optimizer"), record.col("ms", "step (ms)", 1)]


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A results directory that every bench run of the test writes into."""
    out = tmp_path / "results"
    monkeypatch.setenv(record.RESULTS_ENV, str(out))
    return out


def _rendered(path: Path) -> str:
    return tables.render(json.loads(path.read_text()), path.stem)


def test_provenance_from_the_run(results: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command is the bench's own command line relative to the repository, the commit is
    HEAD's (``+dirty`` allowed) in this checkout, the date UTC's YYYY-MM-DD, the machine names torch."""
    monkeypatch.setattr(sys, "argv", [str(record.ROOT / "bench" / "x.py"), "--only", "a b"])
    path = record.write_table("sample", COLUMNS, [{"name": "AdamW", "ms": 1.25}], notes=["Medians."])
    assert path == results / "sample.json"
    data = json.loads(path.read_text())
    assert data["command"] == "python bench/x.py --only 'a b'"
    if (record.ROOT / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?", data["commit"]), data["commit"]
    assert data["date"] == datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    assert f"torch {torch.__version__}" in data["machine"] and "cores" in data["machine"]
    assert _rendered(path).startswith("Command: `python bench/x.py --only 'a b'`. Machine: ")


def test_command_of_a_main_called_with_arguments() -> None:
    """A bench's ``main(argv)`` records its script and those arguments, not the caller's."""
    line = record.command_line(str(record.ROOT / "bench" / "bench_step.py"), ["--tiny", "--write", "t"])
    assert line == "python bench/bench_step.py --tiny --write t"


def test_commit_is_none_outside_a_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record, "ROOT", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert record.commit() is None


@pytest.mark.parametrize(
    ("row", "column"),
    [
        ({"name": 3.5, "ms": 1.0}, "'name'"),  # a number in a column without decimals
        ({"name": "a", "ms": True}, "'ms'"),  # a boolean is no figure
        ({"name": "a", "ms": float("nan")}, "'ms'"),  # JSON has no NaN
        ({"name": "a", "ms": 1.0, "stray": 2}, "stray"),  # a key that is no column
    ],
)
def test_a_row_the_docs_cannot_render_is_refused(results: Path, row: dict[str, Any], column: str) -> None:
    """Refused with one line naming the column; the previous data stays as it was."""
    good = record.write_table("t", COLUMNS, [{"name": "AdamW", "ms": 1.0}])
    before = good.read_text()
    with pytest.raises(ValueError) as info:
        record.write_table("t", COLUMNS, [{"name": "AdamW", "ms": 1.0}, row])
    message = str(info.value)
    assert "\n" not in message and column in message and "row 1" in message, message
    assert good.read_text() == before
    assert sorted(p.name for p in results.iterdir()) == ["t.json"]


def test_the_write_is_atomic(results: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails before the rename leaves the previous file whole and no temporary file."""
    path = record.write_table("t", COLUMNS, [{"name": "AdamW", "ms": 1.0}])
    before = path.read_text()

    def failing(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(record.os, "replace", failing)
    with pytest.raises(OSError, match="disk full"):
        record.write_table("t", COLUMNS, [{"name": "AdamW", "ms": 2.0}])
    assert path.read_text() == before
    assert sorted(p.name for p in results.iterdir()) == ["t.json"]


def test_results_directory_argument_and_bad_names(tmp_path: Path) -> None:
    path = record.write_table("t", COLUMNS, [], results_dir=tmp_path / "elsewhere")
    assert path == tmp_path / "elsewhere" / "t.json"
    with pytest.raises(ValueError, match="table name"):
        record.write_table("../t", COLUMNS, [], results_dir=tmp_path)


def test_present_drops_the_columns_no_row_fills() -> None:
    columns, rows = record.present(COLUMNS, [{"name": "a", "ms": None}])
    assert [c["key"] for c in columns] == ["name"] and rows == [{"name": "a"}]


def test_bench_step_writes_its_table(results: Path) -> None:
    """bench_step.py's single-process mode, a tiny real run, written and rendered."""
    from bench import bench_step

    argv = ["--tiny", "--only", "normuon", "--warmup", "1", "--repeats", "2", "--write", "step_check"]
    bench_step.main(argv)
    data = json.loads((results / "step_check.json").read_text())
    assert data["command"] == "python bench/bench_step.py " + " ".join(argv)
    assert [r["optimizer"] for r in data["rows"]] == ["torch AdamW (foreach)", "dist_optim NorMuon"]
    assert data["rows"][0]["step_vs_adamw"] == 1.0
    assert "| dist_optim NorMuon |" in _rendered(results / "step_check.json")


def test_bench_step_writes_nothing_without_write(results: Path) -> None:
    """Writing is opt-in: a partial run leaves the data alone."""
    from bench import bench_step

    bench_step.main(["--tiny", "--only", "normuon", "--warmup", "0", "--repeats", "1"])
    assert not results.exists()


def test_ns_presets_writes_its_table(results: Path) -> None:
    from bench import ns_presets

    ns_presets.main(["--steps", "1", "--shapes", "8x12"])
    data = json.loads((results / "ns_presets.json").read_text())
    assert data["steps"] == 1 and len(data["rows"]) == 18
    assert "| 8x12 | rank8 | fp32 | jordan |" in _rendered(results / "ns_presets.json")


def test_vs_heavyball_muon_host_writes_its_table(results: Path) -> None:
    from bench import vs_heavyball

    vs_heavyball.main(["--muon-host", "--warmup", "0", "--repeats", "1", "--write", "host"])
    assert [r["iteration"] for r in json.loads((results / "host.json").read_text())["rows"]] == [
        "per matrix",
        "in batches",
    ]
    _rendered(results / "host.json")


def test_vs_heavyball_pair_writes_its_table(results: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in (SGD under heavyball's names) on a tiny set runs the pair's code path up to the
    written table: heavyball's own SOAP would compile its step (torch >= 2.9) or, eager on this
    torch, take far longer than the table's code path needs."""

    class Stand(torch.optim.SGD):
        def __init__(self, params: Any, lr: float = 1e-3, **_: Any) -> None:
            super().__init__(params, lr=lr)

    stub = types.ModuleType("heavyball")
    stub.SOAP = stub.Muon = stub.PSGDKron = Stand  # type: ignore[attr-defined]
    stub.__version__ = "stand-in"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "heavyball", stub)
    from bench import bench_step, vs_heavyball

    monkeypatch.setattr(vs_heavyball, "llama_like", lambda *a: bench_step.llama_like(16, 24, 1, 32))
    vs_heavyball.main(["--only", "soap", "--warmup", "1", "--repeats", "2", "--write", "pair"])
    data = json.loads((results / "pair.json").read_text())
    assert data["heavyball"] == "stand-in"
    assert [r["step"] for r in data["rows"]] == ["ours SOAP", "heavyball SOAP"]
    assert "median_ratio" in data["rows"][0] and "median_ratio" not in data["rows"][1]
    _rendered(results / "pair.json")


def test_kl_runner_separates_kl_from_its_control() -> None:
    """The shared loop of the KL benches: a peer identical to ours differs by 0, and the KL run
    (here: another rate) is told apart from the control."""
    from bench.kl_compare import COLUMNS as KL_COLUMNS
    from bench.kl_compare import kl_on_and_off

    def make(params: list[torch.nn.Parameter], kl: bool) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.2 if kl else 0.1)

    def make_params() -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.ones(3, 2, dtype=torch.float64))]

    def run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int) -> list[torch.Tensor]:
        for _ in range(steps):
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
        return [p.detach().clone() for p in params]

    rows = kl_on_and_off(make, make, make_params, run, 2, ("KL", "control", "KL against control"), "a peer")
    assert [r["run"] for r in rows] == ["KL", "control", "KL against control"]
    assert rows[0]["difference"] == 0.0 and rows[1]["difference"] == 0.0
    assert rows[0]["largest_move"] == pytest.approx(0.4) and rows[2]["difference"] > 0
    columns, kept = record.present(KL_COLUMNS, rows)
    tables.render({"columns": columns, "rows": kept}, "kl")


def test_dist_rows_from_each_ranks_results() -> None:
    """``--dist``'s rows (4 processes are too slow here): the slowest rank's step, its ratio to
    ColossalAI's class of the family, a failed run as its error; ``--bucket-bytes``' A B B A runs."""
    from bench.step_dist import DIST_COLUMNS, OVERLAP_COLUMNS, dist_rows, overlap_rows

    def ran(ms: float, family: str) -> dict[str, Any]:
        return dict(family=family, ms=ms, collectives=3, kib=2.0, first_kib=4.0)

    ranks = [
        {
            "ours": ran(10.0, "lamb"),
            "colossalai DistributedLamb": ran(40.0, "lamb"),
            "x": dict(family="came", error="E"),
        },
        {
            "ours": ran(20.0, "lamb"),
            "colossalai DistributedLamb": ran(30.0, "lamb"),
            "x": dict(family="came", error="E"),
        },
    ]
    rows = dist_rows(ranks, ["lamb", "came"])
    assert [(r["optimizer"], r["step_ms"], r.get("vs_colossalai")) for r in rows] == [
        ("ours", 20.0, 0.5),
        ("colossalai DistributedLamb", 40.0, 1.0),
        ("x", "fails: E", None),
    ]
    tables.render({"columns": DIST_COLUMNS, "rows": rows}, "dist")
    a, b = "dist_optim DistributedShampoo (pieces, buckets of 9 B)", "dist_optim DistributedShampoo (no overlap)"
    ranks = [{a: ran(8.0, "shampoo"), b: ran(10.0, "shampoo"), f"{b}, again": ran(12.0, "shampoo")}]
    (row,) = overlap_rows(ranks, ["shampoo"])
    assert row["overlapped_ms"] == [8.0] and row["sequence_ms"] == [10.0, 12.0] and row["ratio"] == 8.0 / 11.0
    tables.render({"columns": OVERLAP_COLUMNS, "rows": [row]}, "overlap")
