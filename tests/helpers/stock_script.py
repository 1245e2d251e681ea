"""A user's training script as ColossalAI documents it: the stock plugin and optimizer imports
(``--ours``: our optimizer given to the stock plugin), no import of dist_optim's plugins; its tiny
model and batches come from the test helpers, so that another run can reproduce them. Launched by
tests/distributed/test_zero_code_change.py with torchrun, with and without
``python -m dist_optim.plugins.launch``; rank 0 writes what it saw."""

from __future__ import annotations

import argparse
import json
import os

import colossalai
import torch.distributed as dist
from colossalai.booster import Booster
from colossalai.booster.plugin import HybridParallelPlugin
from colossalai.nn.optimizer import Lamb

from dist_optim import DistributedLamb
from dist_optim.testing import tiny_llama
from tests.helpers.booster import rank_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ours", action="store_true", help="pass dist_optim.DistributedLamb to the stock plugin")
    args = parser.parse_args()
    colossalai.launch_from_torch()
    model = tiny_llama()
    optimizer = (DistributedLamb if args.ours else Lamb)(model.parameters(), lr=1e-2, weight_decay=1e-2)
    plugin = HybridParallelPlugin(
        tp_size=2, pp_size=1, zero_stage=args.zero, precision=args.precision, overlap_communication=False
    )
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    dp_size, dp_rank = dist.get_world_size(plugin.dp_group), dist.get_rank(plugin.dp_group)
    losses = []
    for step in range(args.steps):
        x = rank_batch(step, dp_size, dp_rank)
        loss = model(input_ids=x, labels=x).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    booster.save_model(model, os.path.join(args.out, "model.pt"), shard=False)
    booster.save_optimizer(optimizer, os.path.join(args.out, "optim"), shard=True)
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "seen.json"), "w") as f:
            json.dump({"plugin": type(plugin).__module__, "optimizer": type(optimizer.optim).__name__}, f)


if __name__ == "__main__":
    main()
