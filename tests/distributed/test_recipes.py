"""The recipes as a user launches them: torchrun, 4 CPU processes, a couple of steps."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

from recipes import corpus
from tests.helpers.recipe import run_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torchrun(script: str, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", script, *args]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def test_recipe_checkpoint_and_resume(tmp_path, pool4) -> None:
    """Two steps and a checkpoint, then a launch that resumes from it for a third. The first run is
    the recipe's train() on the pool's 4 processes (tests/helpers/recipe.py: what torchrun's launch
    runs, without a launch's imports); the resume is launched as a user launches it."""
    ckpt, log, board = str(tmp_path / "ckpt"), str(tmp_path / "train.csv"), str(tmp_path / "tb")
    common = ["--plugin", "hybrid", "--tp", "2", "--zero", "1", "--no-progress", "--ckpt-dir", ckpt, "--log-csv", log]
    common += ["--tensorboard", board]
    common += ["--optimizer", "transformers.optimization.Adafactor", "--lr", "1e-2"]
    common += ["--optimizer-args", '{"relative_step": false, "scale_parameter": false}']
    pool4.run(run_recipe, [*common, "--steps", "2", "--ckpt-every", "2"])
    assert os.path.exists(os.path.join(ckpt, "step_0000002", "optimizer", "dist_optim_optimizer.index.json"))
    out = _torchrun("recipes/train.py", *common, "--steps", "3", "--resume")
    assert "dist_optim: swapped" in out  # the plugin's log line (ColossalAI's logger wraps it)
    assert "optimizer: dist_optim.factored.adafactor.DistributedAdafactor" in out
    # No --data: the books of recipes/corpus.py train, their held-out part is held out (byte tokens,
    # --seq-len 64: ASCII text, a byte a character).
    train, held = (os.path.getsize(f) // 64 for f in (corpus.TRAIN, corpus.HELDOUT))
    assert f"data: {train} training and {held} held-out sequences of 64 tokens" in out
    assert "resumed from" in out and "final loss" in out
    with open(log) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert all(float(r["loss"]) > 0 for r in rows)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(board)
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [1, 2, 3]
    assert all(abs(e.value - float(r["loss"])) < 1e-5 for e, r in zip(losses, rows))  # fp32 vs 6 decimals


def test_compare_optimizers_on_your_text_writes_the_plot(tmp_path, capsys) -> None:
    """--data: the comparison trains on the given text (the recipe's data log counts its one file
    and its bytes), each optimizer its steps (the CSV), the plot written; a path that does not
    exist is refused before anything starts. One launch for both optimizers: each launch of 4
    processes costs the suite tens of seconds of imports."""
    import pytest

    from recipes.compare_optimizers import main

    text = tmp_path / "mine.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 100, encoding="utf-8")
    png = str(tmp_path / "mine.png")
    out = _torchrun(
        "recipes/compare_optimizers.py", "--steps", "2", "--out", png,
        "--only", "colossalai.nn.optimizer.Lamb", "shampoo",
        "--data", str(text), "--data-cache", str(tmp_path / "cache"),
    )  # fmt: skip
    assert f"data: 1 file(s), {len(text.read_bytes())} byte tokens" in out, out[-2000:]
    assert os.path.getsize(png) > 10_000
    with open(png.replace(".png", ".csv")) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and sorted(r["step"] for r in rows) == ["1", "1", "2", "2"], rows
    with pytest.raises(SystemExit):
        main(["--data", str(tmp_path / "missing.txt")])
    assert "--data '" in capsys.readouterr().err
