"""QK-clip under ColossalAI: the attention logits of a boosted model measured for a Muon built with
``qk_clip_tau`` (:mod:`dist_optim.muon.qk_clip`), reading the mask forms ShardFormer's attention
takes, refused where the sequence is split before attention."""

from __future__ import annotations

from typing import Any

import torch
from colossalai.shardformer.layer.attn import AttnMaskType

from dist_optim.muon.qk_clip import hf_mask, watch_attention_logits

from .fsdp import clean_name

#: Sequence-parallel modes QK-clip measures under: "split_gather" and "ring" gather the sequence
#: over the TP group before the q/k/v projections; "all_to_all" splits it in contiguous pieces
#: over its own group, whose keys the measurement gathers. "ring_attn" (zigzag pieces, varlen
#: batches) is refused.
MEASURED_MODES = (None, "split_gather", "ring", "all_to_all")


def colossal_mask(mask: Any, batch: int, q_len: int, k_len: int) -> torch.Tensor | None:
    """The pairs an attention attends, from ShardFormer's keyword arguments of ``ColoAttention``
    (a dict: causal, or causal with padding given as the valid tokens' flat indices) or from a
    Hugging Face mask (:func:`~dist_optim.muon.qk_clip.hf_mask`). Padded queries attend nothing:
    ColossalAI's varlen kernels drop them."""
    if not isinstance(mask, dict):
        return hf_mask(mask, batch, q_len, k_len)
    kind = mask.get("attention_mask_type")
    if kind == AttnMaskType.CAUSAL:
        return None
    if kind == AttnMaskType.PADDED_CAUSAL:
        valid = torch.zeros(batch * k_len, dtype=torch.bool, device=mask["kv_indices"].device)
        valid[mask["kv_indices"]] = True
        valid = valid.view(batch, k_len)
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=valid.device).tril(diagonal=k_len - q_len)
        return causal[None, None] & valid[:, None, None, :] & valid[:, None, -q_len:, None]
    raise ValueError(
        f"QK-clip reads causal attention masks; this attention got ColossalAI's {kind} mask: leave qk_clip_tau=None "
        "for a model that is not a causal language model"
    )


def watch_boosted(plugin: Any, model: Any, optimizer: Any) -> None:
    """At boost: measure the boosted model's attention logits for ``optimizer`` where it clips
    (``qk_clip_tau`` set), or refuse a sequence-parallel mode that splits the sequence."""
    if getattr(optimizer, "qk_clip_tau", None) is None:
        return
    mode = (
        getattr(plugin, "sequence_parallelism_mode", None)
        if getattr(plugin, "enable_sequence_parallelism", False)
        else None
    )
    if mode not in MEASURED_MODES:
        raise ValueError(
            f"QK-clip (qk_clip_tau={optimizer.qk_clip_tau}) measures each head's logits over the whole sequence, which "
            f"sequence_parallelism_mode={mode!r} cuts in zigzag pieces: use 'split_gather' or 'all_to_all', or "
            "qk_clip_tau=None"
        )
    inner = model.unwrap() if hasattr(model, "unwrap") else model
    sequence = plugin.sp_group if mode == "all_to_all" else None
    watch_attention_logits(inner, optimizer, colossal_mask, clean_name, sequence)
