"""Parameter groups for GaLore from a model (:func:`galore_param_groups`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DEFAULT_TARGETS", "galore_param_groups"]

#: Module-name fragments of attention and MLP blocks (Llama, GPT-2, BERT, OPT, Mistral, ...).
DEFAULT_TARGETS = (r"attn", r"attention", r"mlp", r"ffn", r"feed_forward", r"intermediate", r"output\.dense")


def galore_param_groups(
    model: torch.nn.Module,
    rank: int,
    update_proj_gap: int = 200,
    scale: float = 0.25,
    proj_type: str = "std",
    weight_decay: float = 0.0,
    targets: Iterable[str] = DEFAULT_TARGETS,
    no_decay: Iterable[str] = ("bias", "norm"),
) -> list[dict[str, Any]]:
    """Parameter groups for :class:`DistributedGaLore` (or galore_torch) from a model.

    The 2-D ``weight`` of every module whose qualified name matches one of ``targets`` (regular
    expressions; attention and MLP blocks by default) goes into the GaLore group; embeddings, the
    LM head and other matrices get plain AdamW with ``weight_decay``; parameters whose name contains
    one of ``no_decay`` (biases, norms) get plain AdamW without weight decay. Empty groups are
    dropped. Use it before the model is sharded (as the optimizer is built in ColossalAI).
    """
    patterns = [re.compile(t) for t in targets]
    no_decay = tuple(s.lower() for s in no_decay)
    galore, decay, plain = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        module_name, _, leaf = name.rpartition(".")
        if any(s in name.lower() for s in no_decay):
            plain.append(param)
        elif leaf == "weight" and param.dim() == 2 and any(p.search(module_name) for p in patterns):
            if rank > min(param.shape):
                raise ValueError(f"galore_param_groups: rank={rank} exceeds min{tuple(param.shape)} of {name}")
            galore.append(param)
        else:
            decay.append(param)
    groups = [
        {
            "params": galore,
            "rank": rank,
            "update_proj_gap": update_proj_gap,
            "scale": scale,
            "proj_type": proj_type,
            "weight_decay": weight_decay,
        },
        {"params": decay, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]
