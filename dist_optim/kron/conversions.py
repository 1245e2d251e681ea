"""Kron's registrations, made when the package is imported (so on ``import dist_optim``):
``kron_torch.kron.Kron`` converts to :class:`~dist_optim.kron.optimizer.DistributedKron`
(:func:`dist_optim.convert`, the drop-in plugins), and the planner's ``--optimizer kron``."""

from __future__ import annotations

from typing import Any

import torch

from ..registry import CatalogueEntry, Conversion, Demo, register, register_entry, register_refusals
from .optimizer import DistributedKron
from .schedule import precond_update_prob_schedule

__all__ = ["KRON_TORCH_OPTIONS"]

#: The options of a ``kron_torch.kron.Kron`` param group (0.3.3), all translated.
KRON_TORCH_OPTIONS = frozenset(
    {
        "lr",
        "b1",
        "weight_decay",
        "preconditioner_update_probability",
        "max_size_triangular",
        "min_ndim_triangular",
        "memory_save_mode",
        "precond_lr",
        "precond_init_scale",
        "mu_dtype",
        "precond_dtype",
        "momentum_into_precond_update",
        "merge_dims",
    }
)


def _kron_probability(value: Any) -> Any:
    """kron_torch's ``ProbScheduler`` (torch.compile'd, fp32 tensors) becomes our schedule with the
    same constants; floats and other callables are kept."""
    names = ("max_prob", "min_prob", "decay", "flat_start")
    if type(value).__name__ == "ProbScheduler" and all(hasattr(value, n) for n in names):
        return precond_update_prob_schedule(*(float(getattr(value, n)) for n in names))
    return value


def _kron_torch_kron(opt: torch.optim.Optimizer, g: Any) -> dict[str, Any]:
    return dict(
        lr=g["lr"],
        b1=g["b1"],
        weight_decay=g["weight_decay"],
        preconditioner_update_probability=_kron_probability(g["preconditioner_update_probability"]),
        max_size_triangular=g["max_size_triangular"],
        min_ndim_triangular=g["min_ndim_triangular"],
        memory_save_mode=g["memory_save_mode"],
        momentum_into_precond_update=g.get("momentum_into_precond_update", True),
        precond_lr=g["precond_lr"],
        precond_init_scale=g["precond_init_scale"],
        merge_dims=g.get("merge_dims", True),
        mu_dtype=g.get("mu_dtype"),
        precond_dtype=g.get("precond_dtype"),
        clip_update_rms=True,
    )


register(Conversion("kron_torch.kron.Kron", DistributedKron, _kron_torch_kron, KRON_TORCH_OPTIONS))
# heavyball's (PyPI) PSGDKron converts (.heavyball, variant="heavyball"); the rest of its PSGD family
# preconditions otherwise (eigenbasis Adam, other Q updates, low-rank factors).
register_refusals(
    {
        f"heavyball.{name}": "updates its preconditioner with heavyball's own PSGD kernels"
        for name in ("LATHER", "PSGDPRO", "QSGD", "PSGDLRA")
    },
    DistributedKron,
    "DistributedKron computes kron_torch's Kron and heavyball's PSGDKron, not these: convert heavyball.PSGDKron, "
    "build dist_optim.DistributedKron instead, or keep heavyball on whole parameters (ColossalAI's TorchDDPPlugin)",
)

register_entry(
    CatalogueEntry(
        "kron",
        DistributedKron,
        # The initial scale from each parameter's first gradient (Li's rule): at kron_torch's fixed 1
        # the first updates of small gradients are tiny, and a tiny Llama's loss stays high for ~100 steps.
        recommended={"precond_init_scale": None},
        transient="bucket_bytes (full momenta moved per bucket), max_size_triangular (dense factors)",
        demo=Demo("PSGD Kron (initial scale from the gradient)", 6e-3),
    )
)
