"""The usual Muon/AdamW split of a model's parameters (:func:`muon_param_groups`): hidden matrices
to Muon, embeddings, the output head, norms and biases to the auxiliary AdamW."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DEFAULT_HEAD_NAMES", "muon_param_groups"]


#: Last module-name components taken for the output head (AdamW in :func:`muon_param_groups`).
DEFAULT_HEAD_NAMES = ("lm_head", "head", "output", "classifier", "score")


def muon_param_groups(
    model: torch.nn.Module,
    *,
    head_names: Iterable[str] = DEFAULT_HEAD_NAMES,
    adamw_lr: float | None = None,
    adamw_weight_decay: float | None = None,
    **muon_options: Any,
) -> list[dict[str, Any]]:
    """Parameter groups for :class:`DistributedMuon` from a model: hidden matrices (2-D weights,
    and conv weights, which Muon sees as ``out x (in * kernel)``) in a Muon group; embeddings
    (every parameter of an ``nn.Embedding`` and any parameter tied to one), the output head (a
    module whose last name component is in ``head_names``, or matching one as a regular
    expression) and everything with fewer than 2 dims (norms, biases) in a ``use_muon=False``
    (AdamW) group, with ``adamw_lr`` / ``adamw_weight_decay`` where given. ``muon_options`` go into
    the Muon group (e.g. ``lr``). Each group names its parameters (``param_names``). Empty groups
    are dropped. Use it before the model is sharded (as the optimizer is built in ColossalAI)."""
    heads = [re.compile(f"^{h}$") for h in head_names]
    embedding_params = {
        id(p) for module in model.modules() if isinstance(module, torch.nn.Embedding) for p in module.parameters()
    }
    muon: list[tuple[str, torch.nn.Parameter]] = []
    adamw: list[tuple[str, torch.nn.Parameter]] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        module_name = name.rpartition(".")[0]
        leaf_module = module_name.rpartition(".")[2]
        aux = param.dim() < 2 or id(param) in embedding_params or any(h.match(leaf_module) for h in heads)
        (adamw if aux else muon).append((name, param))
    adamw_group: dict[str, Any] = {"use_muon": False}
    if adamw_lr is not None:
        adamw_group["lr"] = adamw_lr
    if adamw_weight_decay is not None:
        adamw_group["weight_decay"] = adamw_weight_decay
    groups = [
        {"params": [p for _, p in muon], "param_names": [n for n, _ in muon], "use_muon": True, **muon_options},
        {"params": [p for _, p in adamw], "param_names": [n for n, _ in adamw], **adamw_group},
    ]
    return [g for g in groups if g["params"]]
