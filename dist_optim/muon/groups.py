"""The usual Muon/AdamW split of a model's parameters (:func:`muon_param_groups`): hidden matrices
to Muon, embeddings, the output head, norms and biases to the auxiliary AdamW."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DEFAULT_HEAD_NAMES", "HEAD_PROJECTIONS", "muon_param_groups"]


#: Last module-name components taken for the output head (AdamW in :func:`muon_param_groups`).
DEFAULT_HEAD_NAMES = ("lm_head", "head", "output", "classifier", "score")


#: Attention projections whose rows are heads (Llama, Mistral, Qwen2, Mixtral): the module name
#: and the config field counting its heads.
HEAD_PROJECTIONS = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads", "v_proj": "num_key_value_heads"}


def _head_counts(model: torch.nn.Module) -> dict[str, int]:
    """Heads of each attention projection, from the model's Hugging Face config."""
    config = getattr(model, "config", None)
    counts = {}
    for module, field in HEAD_PROJECTIONS.items():
        value = getattr(config, field, None)
        if field == "num_key_value_heads" and value is None:
            value = getattr(config, "num_attention_heads", None)  # transformers' default: no GQA
        if not isinstance(value, int) or value < 1:
            raise ValueError(
                f"muon_param_groups(per_head=True): the model has no config.{field} (a Hugging Face Llama, Mistral, "
                "Qwen2 or Mixtral has one); build the groups by hand with a heads option per group"
            )
        counts[module] = value
    return counts


def muon_param_groups(
    model: torch.nn.Module,
    *,
    head_names: Iterable[str] = DEFAULT_HEAD_NAMES,
    adamw_lr: float | None = None,
    adamw_weight_decay: float | None = None,
    per_head: bool = False,
    **muon_options: Any,
) -> list[dict[str, Any]]:
    """Parameter groups for :class:`DistributedMuon` from a model: hidden matrices (2-D weights,
    and conv weights, which Muon sees as ``out x (in * kernel)``) in a Muon group; embeddings
    (every parameter of an ``nn.Embedding`` and any parameter tied to one), the output head (a
    module whose last name component is in ``head_names``, or matching one as a regular
    expression) and everything with fewer than 2 dims (norms, biases) in a ``use_muon=False``
    (AdamW) group, with ``adamw_lr`` / ``adamw_weight_decay`` where given. ``muon_options`` go into
    the Muon group (e.g. ``lr``). Each group names its parameters (``param_names``). Empty groups
    are dropped. Use it before the model is sharded (as the optimizer is built in ColossalAI).

    ``per_head=True``: the attention projections' weights (``q_proj``, ``k_proj``, ``v_proj``) go
    to Muon groups of their own with ``heads`` set from the model's config (attention heads for q,
    key/value heads for k and v): per-head Muon (:class:`DistributedMuon`'s ``heads``)."""
    heads = [re.compile(f"^{h}$") for h in head_names]
    embedding_params = {
        id(p) for module in model.modules() if isinstance(module, torch.nn.Embedding) for p in module.parameters()
    }
    counts = _head_counts(model) if per_head else {}
    muon: list[tuple[str, torch.nn.Parameter]] = []
    adamw: list[tuple[str, torch.nn.Parameter]] = []
    by_heads: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        module_name = name.rpartition(".")[0]
        leaf_module = module_name.rpartition(".")[2]
        aux = param.dim() < 2 or id(param) in embedding_params or any(h.match(leaf_module) for h in heads)
        if not aux and leaf_module in counts:
            by_heads.setdefault(counts[leaf_module], []).append((name, param))
            continue
        (adamw if aux else muon).append((name, param))
    adamw_group: dict[str, Any] = {"use_muon": False}
    if adamw_lr is not None:
        adamw_group["lr"] = adamw_lr
    if adamw_weight_decay is not None:
        adamw_group["weight_decay"] = adamw_weight_decay
    groups = [
        {"params": [p for _, p in muon], "param_names": [n for n, _ in muon], "use_muon": True, **muon_options},
        *(
            {"params": [p for _, p in ps], "param_names": [n for n, _ in ps], "use_muon": True, **muon_options}
            | {"heads": h}
            for h, ps in by_heads.items()
        ),
        {"params": [p for _, p in adamw], "param_names": [n for n, _ in adamw], **adamw_group},
    ]
    return [g for g in groups if g["params"]]
