"""The recipe's process: the launch (NCCL on GPUs, gloo on CPU processes), its device, and rank 0's
log."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def launch(seed: int) -> torch.device:
    """Initialise the process group from torchrun's environment: NCCL on GPUs, gloo on CPU."""
    import colossalai

    if not torch.cuda.is_available():
        # ColossalAI's CPU accelerator lacks calls its plugins make; dist_optim.plugins.cpu fills them.
        from dist_optim.plugins.cpu import install

        install()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    colossalai.launch_from_torch(seed=seed)
    return current_device()


def current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log(msg: str) -> None:
    if is_main():
        print(msg, flush=True)
