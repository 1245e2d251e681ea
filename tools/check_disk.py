"""Before ``make setup`` installs the pinned stack: is there disk enough for it?

torch 2.5.1 from PyPI is a CUDA build (no CPU build of it is on PyPI) and pulls in the
``nvidia-*`` libraries: the finished virtual environment takes about 6.0 GiB, and pip holds the
downloaded wheels in its temporary directory until it finishes. Measured on a fresh venv with
``pip install -r requirements-dev.txt`` (2026-11-27, venv and temporary directory on one file
system): 9.0 GiB more in use at the peak, 6.0 GiB at the end; the difference, about 3 GiB, is the
downloads (inferred, not measured on its own). With less free space pip fails deep inside with
``OSError: [Errno 28] No space left on device`` after minutes of downloads (a CI run of this
project did); this says so first, in one line, with the numbers.

The thresholds are below what was measured (a margin for other versions of the unpinned
dependencies), so a machine refused here would have run out of disk anyway. Run by the Makefile
with the system Python, before the venv exists: standard library only.

    python3 tools/check_disk.py .venv
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

GIB = 2**30
#: Refused below these (GiB): where the venv and pip's temporary directory share a file system,
#: the peak of both (9.0 measured); else the venv's 6.0 and the downloads' ~3, each on its own.
SHARED_MIN = 8.5
VENV_MIN = 5.5
TEMP_MIN = 2.5


def _existing(path: str) -> str:
    """``path`` or its nearest existing parent (the venv does not exist before the set-up)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def shortfalls(venv: str, temp: str | None = None) -> list[str]:
    """One message per file system with less free space than the set-up needs; empty if none,
    and empty where the venv exists already (an update installs only what changed)."""
    if os.path.exists(venv):
        return []
    venv_dir = _existing(venv)
    temp_dir = _existing(temp or tempfile.gettempdir())
    if os.stat(venv_dir).st_dev == os.stat(temp_dir).st_dev:
        needs = [(venv_dir, SHARED_MIN, "the virtual environment and pip's downloads (9.0 GiB at the peak)")]
    else:
        needs = [
            (venv_dir, VENV_MIN, "the virtual environment (6.0 GiB)"),
            (temp_dir, TEMP_MIN, "pip's downloads in its temporary directory (about 3 GiB)"),
        ]
    out = []
    for path, least, what in needs:
        free = shutil.disk_usage(path).free / GIB
        if free < least:
            out.append(
                f"make setup: {free:.1f} GiB free on {path}, too little for {what}; "
                f"free at least {least:.1f} GiB there, or set VENV (make VENV=...) or TMPDIR to a larger disk"
            )
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 tools/check_disk.py VENV_PATH", file=sys.stderr)
        return 2
    problems = shortfalls(argv[0])
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
