"""The one writer of a bench's results: ``bench/results/NAME.json`` in the table format of
:mod:`bench.tables`, with its provenance filled in from the run itself.

A figure copied by hand from a terminal into a data file loses the command, commit and machine
that produced it, or gets them wrong; and a file that the docs cannot render is found only when
the docs are rebuilt. So every bench writes through :func:`write_table`: it records the command
line the bench was started with, the commit (marked ``+dirty`` when tracked files differ from it),
the machine and the date, renders the table once with :func:`bench.tables.render` (a row the docs
could not show is refused before anything is written), and replaces the file atomically (a run
killed mid-write leaves the previous data whole).

Writing is opt-in (each bench's ``--write NAME``): a partial run, ``--only lamb`` say, must never
overwrite the data of a table that holds every row. ``DIST_OPTIM_BENCH_RESULTS`` names another
results directory (the tests write there, never into ``bench/results``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import tables

__all__ = [
    "RESULTS_ENV",
    "Column",
    "col",
    "command_line",
    "commit",
    "cpu_name",
    "machine",
    "present",
    "results_location",
    "today",
    "write_table",
]

ROOT = tables.ROOT
RESULTS_ENV = "DIST_OPTIM_BENCH_RESULTS"
#: A table's file name: what a doc's ``<!-- table: NAME -->`` marker accepts.
NAME = re.compile(r"^[\w.-]+$")

Column = dict[str, Any]


def col(key: str, label: str, decimals: int | None = None, **fmt: Any) -> Column:
    """One column of the table format (``suffix``, ``format``, ``thousands`` through ``fmt``)."""
    out: Column = {"key": key, "label": label}
    if decimals is not None:
        out["decimals"] = decimals
    return {**out, **fmt}


def present(columns: Sequence[Column], rows: Sequence[Mapping[str, Any]]) -> tuple[list[Column], list[dict[str, Any]]]:
    """The columns that some row fills, and the rows without the others' keys: a bench that measures
    a figure for some rows only (the amortised step of a refreshing optimizer) shows no empty column
    for a run without any."""
    kept = [c for c in columns if any(r.get(c["key"]) is not None for r in rows)]
    dropped = {c["key"] for c in columns} - {c["key"] for c in kept}
    return kept, [{k: v for k, v in r.items() if k not in dropped} for r in rows]


def results_location(override: str | os.PathLike[str] | None = None) -> Path:
    """Where tables are written: ``override``, else ``$DIST_OPTIM_BENCH_RESULTS``, else bench/results."""
    chosen = override or os.environ.get(RESULTS_ENV)
    return Path(chosen) if chosen else tables.RESULTS


def command_line(script: str | None = None, argv: Sequence[str] | None = None) -> str:
    """``python bench/x.py ARGS`` as the bench was started: ``script`` (default ``sys.argv[0]``)
    relative to the repository root, then ``argv`` (default ``sys.argv[1:]``), quoted for a shell."""
    path = Path(script if script is not None else sys.argv[0]).resolve()
    try:
        shown = str(path.relative_to(ROOT))
    except ValueError:
        shown = str(path)
    args = list(argv) if argv is not None else sys.argv[1:]
    return shlex.join(["python", shown, *args])


def _git(*args: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None


def commit() -> str | None:
    """The short hash of HEAD, ``+dirty`` when tracked files have changes not in it (the figures
    then come from code no commit holds); None outside a git checkout."""
    head = _git("rev-parse", "--short", "HEAD")
    if head is None or head.returncode != 0 or not head.stdout.strip():
        return None
    status = _git("status", "--porcelain", "--untracked-files=no")
    dirty = status is None or status.returncode != 0 or bool(status.stdout.strip())
    return head.stdout.strip() + ("+dirty" if dirty else "")


def cpu_name() -> str:
    """The CPU's model name (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("s" if n != 1 else "")


def machine(device: str = "cpu") -> str:
    """The CPU, its cores, the threads torch uses and torch's version; the GPU's name when the rows
    ran on ``device`` ``cuda...`` (a GPU row's figures depend on the card more than on the host)."""
    import torch

    cores, threads = os.cpu_count() or 1, torch.get_num_threads()
    parts = [cpu_name(), _count(cores, "core"), _count(threads, "thread"), f"torch {torch.__version__}"]
    if device.startswith("cuda"):
        parts.insert(0, torch.cuda.get_device_name(device))
    return ", ".join(parts)


def today() -> str:
    """The UTC date, YYYY-MM-DD: a table's runs are dated alike wherever they ran."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def _finite(rows: Sequence[Mapping[str, Any]]) -> None:
    """A NaN or infinity has no JSON form: name its row and column rather than fail in ``json``."""
    for i, row in enumerate(rows):
        for key, value in row.items():
            values = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                raise ValueError(f"row {i}: column {key!r}: {value!r} holds a non-finite number (JSON has none)")


def write_table(
    name: str,
    columns: Sequence[Column],
    rows: Iterable[Mapping[str, Any]],
    notes: Sequence[str] = (),
    results_dir: str | os.PathLike[str] | None = None,
    *,
    device: str = "cpu",
    script: str | None = None,
    argv: Sequence[str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``NAME.json`` (table format of :mod:`bench.tables`) into ``results_dir`` (see
    :func:`results_location`) and return its path.

    ``command``, ``commit``, ``machine`` and ``date`` come from this run (``script``/``argv``: the
    bench's own when its ``main`` was called with an argument list rather than from the command
    line; ``device``: where the rows ran). ``extra`` adds data fields (a peer's commit, the shapes)
    that the docs do not render. Raises ValueError, one line naming the row and column, for a table
    that :func:`bench.tables.render` cannot render; nothing is written then.
    """
    if not NAME.match(name):
        raise ValueError(f"table name {name!r}: letters, digits, '_', '.' and '-' only (a doc marker's name)")
    data: dict[str, Any] = {
        "command": command_line(script, argv),
        "commit": commit(),
        "machine": machine(device),
        "date": today(),
    }
    for key, value in (extra or {}).items():
        if key in data or key in ("columns", "rows", "notes"):
            raise ValueError(f"extra field {key!r} would replace the table's own")
        data[key] = value
    data.update(columns=[dict(c) for c in columns], rows=[dict(r) for r in rows], notes=list(notes))
    try:
        _finite(data["rows"])
        tables.render(data, name)
        text = json.dumps(data, indent=1, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        message = " ".join(str(e).split())  # one line, whatever the cause printed
        raise ValueError(f"not written, the docs could not render it: {message}") from e
    out_dir = results_location(results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{name}.json"
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out_dir)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would hide the data from the other users of the checkout
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    print(f"written: {target}")
    return target
