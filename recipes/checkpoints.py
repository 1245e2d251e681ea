"""Checkpoints of a run through the booster: model, optimizer and schedule by step, and the
``latest`` pointer a resume reads."""

from __future__ import annotations

import json
import os
from typing import Any

import torch.distributed as dist

from recipes.env import is_main, log


def save_checkpoint(booster: Any, model: Any, optimizer: Any, scheduler: Any, step: int, ckpt_dir: str) -> None:
    path = os.path.join(ckpt_dir, f"step_{step:07d}")
    os.makedirs(path, exist_ok=True)
    booster.save_model(model, os.path.join(path, "model"), shard=True)
    booster.save_optimizer(optimizer, os.path.join(path, "optimizer"), shard=True)
    booster.save_lr_scheduler(scheduler, os.path.join(path, "lr_scheduler"))
    dist.barrier()
    if is_main():
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump({"step": step}, f)
        with open(os.path.join(ckpt_dir, "latest"), "w") as f:
            f.write(os.path.basename(path))
    dist.barrier()
    log(f"saved checkpoint {path}")


def load_checkpoint(booster: Any, model: Any, optimizer: Any, scheduler: Any, ckpt_dir: str) -> int:
    latest = os.path.join(ckpt_dir, "latest")
    if not os.path.exists(latest):
        raise SystemExit(f"--resume: no checkpoint in {ckpt_dir}")
    with open(latest) as f:
        path = os.path.join(ckpt_dir, f.read().strip())
    booster.load_model(model, os.path.join(path, "model"))
    booster.load_optimizer(optimizer, os.path.join(path, "optimizer"))
    booster.load_lr_scheduler(scheduler, os.path.join(path, "lr_scheduler"))
    with open(os.path.join(path, "meta.json")) as f:
        step = int(json.load(f)["step"])
    log(f"resumed from {path} at step {step}")
    return step
