"""Conversions to :class:`~dist_optim.galore.DistributedGaLore` from the GaLore optimizers users
have (galore_torch's ``GaLoreAdamW`` / ``GaLoreAdamW8bit``, ColossalAI's ``GaLoreAdamW8bit`` /
``DistGaloreAwamW``, the latter two on bitsandbytes), and GaLore's planner entry. Imported by the
package, so ``import dist_optim`` registers them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..registry import CatalogueEntry, Conversion, Demo, register, register_entry
from ..states import bnb
from .groups import galore_param_groups
from .optimizer import DistributedGaLore
from .options import GROUP_DEFAULTS

__all__: list[str] = []

_GALORE_KEYS = ("rank", "update_proj_gap", "scale", "proj_type")


def _galore_keys(g: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    if "rank" not in g:
        return {}
    out = {"rank": g["rank"]}
    for key in _GALORE_KEYS[1:]:
        if key in g:
            out[key] = g[key]
        elif key in defaults:
            out[key] = defaults[key]
        else:
            raise ValueError(f"convert: GaLore group with rank={g['rank']} has no {key!r}")
    return out  # checked by DistributedGaLore.validate_group


def _galore_torch_adamw(opt: torch.optim.Optimizer, g: Mapping[str, Any]) -> dict[str, Any]:
    # galore_torch.GaLoreAdamW reads group["update_proj_gap"] etc. with no default.
    return dict(
        lr=g["lr"],
        betas=tuple(g["betas"]),
        eps=g["eps"],
        weight_decay=g["weight_decay"],
        correct_bias=bool(g["correct_bias"]),
        optim_bits=32,
        adam_style="hf",
        **_galore_keys(g, {}),
    )


def _bnb_galore(opt: torch.optim.Optimizer, g: Mapping[str, Any], positional_shift: bool) -> dict[str, Any]:
    args = getattr(opt, "args", None)
    if positional_shift and args is not None:
        # galore_torch.GaLoreAdamW8bit passes (min_8bit_size, percentile_clipping, block_wise)
        # positionally; on bitsandbytes >= 0.45 those land in (min_8bit_size, max_unorm,
        # skip_zeros). Read them back as what the user wrote.
        args = {
            "optim_bits": getattr(args, "optim_bits", 8),
            "min_8bit_size": getattr(args, "min_8bit_size", 4096),
            "percentile_clipping": getattr(args, "max_unorm", 100),
            "block_wise": getattr(args, "skip_zeros", True),
        }
    quant = bnb.quant_args(args, "DistributedGaLore") if args is not None else {}
    if "weight_decay_saved" in g:
        raise ValueError("convert: the optimizer is in the middle of a step (weight_decay_saved is set)")
    return dict(
        lr=g["lr"],
        betas=tuple(g["betas"][:2]),
        eps=g["eps"],
        weight_decay=g["weight_decay"],
        correct_bias=True,
        optim_bits=quant.get("optim_bits", 8),
        min_8bit_size=quant.get("min_8bit_size", 4096),
        is_paged=bool(getattr(opt, "is_paged", False)),
        adam_style="bnb",
        **_galore_keys(g, GROUP_DEFAULTS),
    )


def _galore_torch_8bit(opt: torch.optim.Optimizer, g: Mapping[str, Any]) -> dict[str, Any]:
    import inspect

    from bitsandbytes.optim.optimizer import Optimizer2State

    shifted = "percentile_clipping" not in inspect.signature(Optimizer2State.__init__).parameters
    return _bnb_galore(opt, g, positional_shift=shifted)


def _colossal_galore_8bit(opt: torch.optim.Optimizer, g: Mapping[str, Any]) -> dict[str, Any]:
    return _bnb_galore(opt, g, positional_shift=False)


_HF_READS = frozenset({"lr", "betas", "eps", "weight_decay", "correct_bias", *_GALORE_KEYS})
_BNB_READS = frozenset({"lr", "betas", "eps", "weight_decay", *_GALORE_KEYS})
# bitsandbytes' AdEMAMix options in Optimizer2State's defaults: only their "off" values convert.
_BNB_NEUTRAL = {"alpha": 0.0, "t_alpha": None, "t_beta3": None}

register(Conversion("galore_torch.adamw.AdamW", DistributedGaLore, _galore_torch_adamw, _HF_READS))
register(
    Conversion("galore_torch.adamw8bit.AdamW8bit", DistributedGaLore, _galore_torch_8bit, _BNB_READS, _BNB_NEUTRAL)
)
for _path in (
    "colossalai.nn.optimizer.galore.GaLoreAdamW8bit",
    "colossalai.nn.optimizer.distributed_galore.DistGaloreAwamW",
):
    register(Conversion(_path, DistributedGaLore, _colossal_galore_8bit, _BNB_READS, _BNB_NEUTRAL))
del _path

register_entry(
    CatalogueEntry(
        "galore",
        DistributedGaLore,
        recommended={"rank": 8, "update_proj_gap": 50},
        param_groups=galore_param_groups,
        plan_options={"rank": 128},
        refresh={"update_proj_gap": 2},
        transient=(
            "bucket_bytes (full gradients at the SVD owners per refresh bucket, low-rank sums per bucket), the rank"
        ),
        demo=Demo("GaLore (rank 8)", 3e-2),
    )
)
