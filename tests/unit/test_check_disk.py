"""tools/check_disk.py, the Makefile's check before it installs the pinned stack: one line with the
free space, the need and the fix where the disk is too small; silent where it is not, and where the
venv exists already (an update installs only what changed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tools import check_disk

ROOT = Path(__file__).resolve().parents[2]


def _free(gib_by_dir: Callable[[str], float]) -> Callable[[str], Any]:
    real = shutil.disk_usage

    def usage(path: str) -> Any:
        total, used, _ = real(path)
        return type(real(path))(total, used, int(gib_by_dir(os.path.abspath(path)) * check_disk.GIB))

    return usage


def test_a_small_shared_disk_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(shutil, "disk_usage", _free(lambda _: 8.0))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # pip's temporary directory, as TMPDIR sets it
    assert check_disk.main([str(tmp_path / ".venv")]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert f"8.0 GiB free on {tmp_path}" in lines[0] and "at least 8.5 GiB" in lines[0] and "VENV" in lines[0]


def test_enough_disk_and_an_existing_venv_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "disk_usage", _free(lambda _: 8.6))
    assert check_disk.shortfalls(str(tmp_path / "new" / ".venv"), str(tmp_path)) == []
    monkeypatch.setattr(shutil, "disk_usage", _free(lambda _: 0.1))
    (tmp_path / ".venv").mkdir()
    assert check_disk.shortfalls(str(tmp_path / ".venv"), str(tmp_path)) == []


def test_separate_file_systems_are_checked_each_for_its_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv_dir, temp_dir = tmp_path / "repo", tmp_path / "tmp"
    venv_dir.mkdir()
    temp_dir.mkdir()
    real_stat = os.stat

    def stat(path: Any, *args: Any, **kwargs: Any) -> Any:
        st = real_stat(path, *args, **kwargs)
        if os.path.abspath(path) == str(temp_dir):  # another device
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev + 1, *tuple(st)[3:]))
        return st

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(shutil, "disk_usage", _free(lambda p: 6.0 if p == str(venv_dir) else 2.0))
    lines = check_disk.shortfalls(str(venv_dir / ".venv"), str(temp_dir))
    assert len(lines) == 1 and str(temp_dir) in lines[0] and "2.0 GiB free" in lines[0]
    monkeypatch.setattr(shutil, "disk_usage", _free(lambda p: 5.0 if p == str(venv_dir) else 3.0))
    lines = check_disk.shortfalls(str(venv_dir / ".venv"), str(temp_dir))
    assert len(lines) == 1 and str(venv_dir) in lines[0] and "5.0 GiB free" in lines[0]


def test_the_script_runs_with_the_standard_library_alone(tmp_path: Path) -> None:
    """As the Makefile runs it, with the system Python before any venv: isolated (-I), so that
    nothing from this environment's site-packages or the repository is importable."""
    script = ROOT / "tools" / "check_disk.py"
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # one file system: the shared threshold
    venv = str(tmp_path / ".venv")
    done = subprocess.run([sys.executable, "-I", "-S", str(script), venv], capture_output=True, env=env)
    free = shutil.disk_usage(tmp_path).free / check_disk.GIB
    assert done.returncode == (0 if free >= check_disk.SHARED_MIN else 1), done.stderr
    usage = subprocess.run([sys.executable, "-I", "-S", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr
