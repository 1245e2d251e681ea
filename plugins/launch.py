"""``python -m dist_optim.plugins.launch [--cpu] COMMAND ...``: zero code change.

Runs ``COMMAND`` (``torchrun ...``, ``colossalai run ...``, ``python train.py``) so that in every
Python process it starts, the stock ColossalAI plugins are dist_optim's drop-ins: an unchanged
script that imports ``colossalai.booster.plugin.HybridParallelPlugin`` (or LowLevelZero, TorchDDP,
MoeHybrid) and boosts an ordinary optimizer trains with its distributed version, bound to the
real layouts. How: ``PYTHONPATH`` starts with a folder whose ``sitecustomize.py`` installs the
swap at start-up, after running any ``sitecustomize`` it shadows, and ``DIST_OPTIM_SWAP=1``.
``--cpu`` also sets ``DIST_OPTIM_CPU=1``: ColossalAI's plugins then run on CPU processes (gloo).

A process started with ``python -I``, ``-E`` or ``-S`` ignores ``PYTHONPATH`` or ``sitecustomize``
and runs the stock plugins; ``colossalai run`` over several nodes starts its commands through ssh,
which does not pass the environment on: launch each node's ``torchrun`` under this command instead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

__all__ = ["STARTUP", "environment", "main"]

#: The folder put first on PYTHONPATH: its only module is the start-up hook.
STARTUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")


def environment(base: dict[str, str], cpu: bool = False) -> dict[str, str]:
    """``base`` with the swap switched on (and CPU processes with ``cpu``)."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (STARTUP, base.get("PYTHONPATH", "")) if p)
    env["DIST_OPTIM_SWAP"] = "1"
    if cpu:
        env["DIST_OPTIM_CPU"] = "1"
    return env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dist_optim.plugins.launch",
        description="Run COMMAND with ColossalAI's stock plugins swapped for dist_optim's drop-ins.",
    )
    parser.add_argument("--cpu", action="store_true", help="run ColossalAI's plugins on CPU processes (gloo)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="torchrun ..., colossalai run ..., python ...")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the command to run, e.g. torchrun --nproc_per_node 8 train.py")
    program = shutil.which(args.command[0])
    if program is None:
        parser.error(f"command {args.command[0]!r} not found on PATH")
    os.execve(program, args.command, environment(dict(os.environ), args.cpu))


if __name__ == "__main__":
    main(sys.argv[1:])
