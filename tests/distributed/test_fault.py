"""A rank killed mid-run: the job exits non-zero within a bounded time, and resuming from the last
checkpoint continues exactly the trajectory of an uninterrupted run."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time

import psutil

from tests.helpers.recipe import run_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 8


def _args(ckpt: str, log: str, *extra: str) -> list[str]:
    return [
        "--plugin", "hybrid", "--tp", "2", "--zero", "1", "--optimizer", "colossalai.nn.optimizer.Lamb",
        "--lr", "1e-2", "--steps", str(STEPS), "--no-progress", "--ckpt-dir", ckpt, "--ckpt-every", "2",
        "--log-csv", log, *extra,
    ]  # fmt: skip


def _cmd(ckpt: str, log: str, *extra: str) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"]
    return [*launcher, "recipes/train.py", *_args(ckpt, log, *extra)]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


def _losses(path: str) -> dict[int, str]:
    with open(path) as f:
        return {int(r["step"]): r["loss"] for r in csv.DictReader(f)}


def test_killed_rank_fails_the_job_and_resume_continues_the_trajectory(pool4, tmp_path) -> None:
    # The uninterrupted and the resumed runs on the pool's 4 processes (tests/helpers/recipe.py: the
    # recipe's train() as torchrun's launch would run it, a launch of imports cheaper); the killed run
    # is launched as a user launches it (a resume so launched is test_recipes.py's).
    straight_log = str(tmp_path / "straight.csv")
    pool4.run(run_recipe, _args(str(tmp_path / "ck0"), straight_log))

    ckpt, log = str(tmp_path / "ck1"), str(tmp_path / "killed.csv")
    proc = subprocess.Popen(_cmd(ckpt, log), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline:  # wait for a checkpoint (step 2 or 4), then kill one worker
        if os.path.exists(os.path.join(ckpt, "latest")) and os.path.exists(log) and len(_losses(log)) >= 4:
            break
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        time.sleep(0.2)
    workers = [
        c for c in psutil.Process(proc.pid).children(recursive=True) if "recipes/train.py" in " ".join(c.cmdline())
    ]
    assert len(workers) == 4
    killed_at = time.time()
    os.kill(workers[1].pid, signal.SIGKILL)
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert time.time() - killed_at < 120

    with open(os.path.join(ckpt, "latest")) as f:
        resumed_from = int(f.read().strip().split("_")[1])
    # The killed run checkpointed every 2 steps and logged at least 4 before the kill.
    assert resumed_from in (2, 4, 6), resumed_from
    with open(log) as f:
        rows_before = len(list(csv.DictReader(f)))
    out = pool4.run(run_recipe, _args(ckpt, log, "--resume"))[0]
    assert f"at step {resumed_from}" in out, out[-3000:]
    with open(log) as f:
        appended = [int(r["step"]) for r in list(csv.DictReader(f))[rows_before:]]
    # The resumed run logged exactly the steps after its checkpoint, and they are the uninterrupted
    # run's losses.
    assert appended == list(range(resumed_from + 1, STEPS + 1)), (resumed_from, appended)
    straight, resumed = _losses(straight_log), _losses(log)
    for step in range(resumed_from + 1, STEPS + 1):
        assert resumed[step] == straight[step], (step, resumed[step], straight[step])
