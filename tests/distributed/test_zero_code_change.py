"""Zero code change: an unchanged training script that imports the stock ColossalAI plugin
(tests/helpers/stock_script.py: HybridParallelPlugin tp=2 x ZeRO-1 over dp=2, bf16, an ordinary
``colossalai.nn.optimizer.Lamb``), launched with torchrun on 4 CPU processes.

* Under ``python -m dist_optim.plugins.launch``: the plugin it built is dist_optim's, the optimizer
  became DistributedLamb, and the model and the optimizer checkpoint it saved are, bit for bit,
  those of the same run with ``dist_optim.plugins.HybridParallelPlugin`` imported by name (options,
  layouts and our checkpoint IO all kept).
* Without it, our DistributedLamb given to the stock plugin at tp=2 with ZeRO off in fp32 (where
  it holds the TP slices themselves) is never bound, and refuses its first step, naming the fix,
  instead of training on slices."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

import torch

from dist_optim.plugins.checkpoint import read_checkpoint
from dist_optim.plugins.launch import STARTUP
from tests.helpers.check import differences

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "helpers", "stock_script.py")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


def _torchrun(args: list[str]) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
        "--master_port", str(port), SCRIPT, *args,
    ]  # fmt: skip


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    # One thread per process, as the pool's workers run (bit-for-bit comparison with them).
    env = {
        **env,
        "PYTHONPATH": os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), ROOT) if p),
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=480)


def reference(out: str) -> None:
    """The same run with our plugin imported by name (a DistPool worker)."""
    from colossalai.booster import Booster

    from dist_optim.plugins import HybridParallelPlugin
    from dist_optim.plugins.cpu import install
    from dist_optim.testing import tiny_llama
    from tests.helpers.booster import train_boosted

    install()
    model = tiny_llama()
    from colossalai.nn.optimizer import Lamb

    optimizer = Lamb(model.parameters(), lr=1e-2, weight_decay=1e-2)
    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=1, precision="bf16", overlap_communication=False)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    train_boosted(booster, model, optimizer, plugin, range(3))
    booster.save_model(model, os.path.join(out, "model.pt"), shard=False)
    booster.save_optimizer(optimizer, os.path.join(out, "optim"), shard=True)


def _saved(folder: str) -> dict[str, Any]:
    payload = read_checkpoint(os.path.join(folder, "optim"))  # refuses anything but our format
    return {"model": torch.load(os.path.join(folder, "model.pt"), weights_only=True), "state": payload["state"]}


def test_the_launcher_swaps_the_stock_plugins_as_our_classes_do(pool4, tmp_path) -> None:
    launched, ours = str(tmp_path / "launched"), str(tmp_path / "ours")
    os.makedirs(launched)
    os.makedirs(ours)
    command = [sys.executable, "-m", "dist_optim.plugins.launch", "--cpu", *_torchrun(["--out", launched])]
    done = _run(command, dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    seen = open(os.path.join(launched, "seen.json")).read()
    assert '"plugin": "dist_optim.plugins"' in seen and '"optimizer": "DistributedLamb"' in seen, seen
    pool4.run(reference, ours)
    got, expected = _saved(launched), _saved(ours)
    assert got["model"] and got["state"]
    assert differences(got, expected) == [], differences(got, expected)[:10]


def test_without_the_launcher_a_sliced_unbound_optimizer_refuses_to_step(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": STARTUP, "DIST_OPTIM_CPU": "1"}  # CPU processes, stock plugins
    env.pop("DIST_OPTIM_SWAP", None)
    done = _run(_torchrun(["--ours", "--zero", "0", "--precision", "fp32", "--out", str(tmp_path)]), env)
    assert done.returncode != 0
    assert "are tensor-parallel slices: boost through dist_optim.plugins" in done.stderr, done.stderr[-3000:]
    assert "python -m dist_optim.plugins.launch" in done.stderr
