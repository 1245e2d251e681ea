"""Conversions to :class:`~dist_optim.muon.DistributedMuon` from the Muon classes users have
(``torch.optim.Muon``, KellerJordan's ``muon`` package) and to
:class:`~dist_optim.muon.DistributedNorMuon` from the NorMuon authors' ``normuon`` module, and their
planner entries; imported by the package so that they register on ``import dist_optim``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..registry import CatalogueEntry, Conversion, Demo, register, register_entry
from .coefficients import DEFAULT_NS_COEFFICIENTS
from .groups import muon_param_groups
from .normuon import NEURON_STATE, DistributedNorMuon, moment_dtype
from .optimizer import DistributedMuon

__all__: list[str] = []


def _muon_state(state: Any) -> dict[str, Any]:
    """A Muon parameter's state (momentum_buffer, the EMA form in both sources) or an auxiliary
    Adam parameter's (exp_avg, exp_avg_sq, an integer step in KellerJordan's)."""
    out: dict[str, Any] = {}
    if "momentum_buffer" in state:
        out["momentum_buffer"] = state["momentum_buffer"]
    if "exp_avg" in state:
        out["exp_avg"] = state["exp_avg"]
        out["exp_avg_sq"] = state["exp_avg_sq"]
        out["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
    return out


def _torch_muon(opt: torch.optim.Optimizer, g: Any) -> dict[str, Any]:
    # torch >= 2.9 documents B <- momentum B + G but computes the EMA (buf.lerp_(grad, 1 - momentum),
    # update = grad.lerp(buf, momentum)), divides by norm.clamp(min=eps) and iterates in bfloat16.
    return dict(
        lr=g["lr"],
        weight_decay=g["weight_decay"],
        momentum=g["momentum"],
        nesterov=bool(g["nesterov"]),
        ns_coefficients=tuple(g["ns_coefficients"]),
        eps=g["eps"],
        ns_steps=g["ns_steps"],
        adjust_lr_fn=g["adjust_lr_fn"],
        ns_dtype=torch.bfloat16,
        momentum_ema=True,
        eps_form="max",
        use_muon=True,
    )


def _normuon_state(state: Any) -> dict[str, Any]:
    """A NorMuon parameter's state: Muon's, and the neuron-wise second moment (``rows x 1`` in the
    authors' code, the parameter's dtype) as ours (``rows``, at least float32)."""
    out = _muon_state(state)
    v = state.get("second_momentum_buffer")
    if v is not None:
        out[NEURON_STATE] = v.reshape(-1).to(moment_dtype(v))
    return out


def _keller_jordan_muon_group(g: Any, name: str, module: str = "muon") -> dict[str, Any]:
    cls = DistributedNorMuon if module == "normuon" else DistributedMuon
    for p in g.get("params", ()):
        if p.dim() != 2:
            raise ValueError(
                f"convert: {module}.{name} holds a parameter of shape {tuple(p.shape)}; KellerJordan's Muon (and "
                "NorMuon, written from it) flattens 4-D weights but scales their update by the kernel's dims, and "
                f"batches 3-D ones over their first dim, which {cls.__name__} does not reproduce: convert with 2-D "
                f"parameters only, or build {cls.__name__}(dist_optim.muon_param_groups(model)) directly"
            )
    extra = dict(beta2=g.get("beta2", 0.95), normalization_eps=1e-10) if module == "normuon" else {}
    return dict(
        **extra,
        lr=g.get("lr", 0.02),
        weight_decay=g.get("weight_decay", 0.0),
        momentum=g.get("momentum", 0.95),
        nesterov=True,
        ns_coefficients=DEFAULT_NS_COEFFICIENTS,
        eps=1e-7,
        ns_steps=5,
        adjust_lr_fn="original",
        ns_dtype=torch.bfloat16,
        momentum_ema=True,
        eps_form="add",
        use_muon=True,
    )


def _keller_jordan_muon(name: str, module: str = "muon") -> Callable[[torch.optim.Optimizer, Any], dict[str, Any]]:
    def options(opt: torch.optim.Optimizer, g: Any) -> dict[str, Any]:
        return _keller_jordan_muon_group(g, name, module)

    return options


def _keller_jordan_aux(name: str, module: str = "muon") -> Callable[[torch.optim.Optimizer, Any], dict[str, Any]]:
    def options(opt: torch.optim.Optimizer, g: Any) -> dict[str, Any]:
        if "use_muon" not in g:
            raise KeyError("use_muon")  # the empty defaults of these classes: no options to take
        if g["use_muon"]:
            return _keller_jordan_muon_group(g, name, module)
        return dict(
            lr=g["lr"],
            weight_decay=g["weight_decay"],
            adamw_betas=tuple(g["betas"]),
            adamw_eps=g["eps"],
            use_muon=False,
        )

    return options


_TORCH_MUON_READS = frozenset(
    {"lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn"}
)
# torch.optim.Muon's class reports the module torch.optim (torch >= 2.9); the file is torch/optim/_muon.py.
for _path in ("torch.optim.Muon", "torch.optim._muon.Muon"):
    register(
        Conversion(
            _path,
            DistributedMuon,
            _torch_muon,
            _TORCH_MUON_READS,
            state=_muon_state,
        )
    )
# KellerJordan's package (github.com/KellerJordan/Muon, module ``muon``; PyPI's ``muon`` is unrelated).
for _name in ("Muon", "SingleDeviceMuon"):
    register(
        Conversion(
            f"muon.{_name}",
            DistributedMuon,
            _keller_jordan_muon(_name),
            frozenset({"lr", "weight_decay", "momentum"}),
            state=_muon_state,
        )
    )
for _name in ("MuonWithAuxAdam", "SingleDeviceMuonWithAuxAdam"):
    register(
        Conversion(
            f"muon.{_name}",
            DistributedMuon,
            _keller_jordan_aux(_name),
            frozenset({"lr", "weight_decay", "momentum", "use_muon", "betas", "eps"}),
            state=_muon_state,
        )
    )

# The NorMuon authors' module (github.com/zichongli5/NorMuon, ``normuon.py``, installed as ``normuon``):
# KellerJordan's four classes with the neuron-wise normalization and its beta2.
for _name in ("NorMuon", "SingleDeviceNorMuon"):
    register(
        Conversion(
            f"normuon.{_name}",
            DistributedNorMuon,
            _keller_jordan_muon(_name, "normuon"),
            frozenset({"lr", "weight_decay", "momentum", "beta2"}),
            state=_normuon_state,
        )
    )
for _name in ("NorMuonWithAuxAdam", "SingleDeviceNorMuonWithAuxAdam"):
    register(
        Conversion(
            f"normuon.{_name}",
            DistributedNorMuon,
            _keller_jordan_aux(_name, "normuon"),
            frozenset({"lr", "weight_decay", "momentum", "beta2", "use_muon", "betas", "eps"}),
            state=_normuon_state,
        )
    )

_TRANSIENT = "bucket_bytes (full C moved per bucket), ns_dtype (Newton-Schulz workspace)"
# Muon's update RMS matched to AdamW's (Liu et al. 2025), so one lr serves the Muon matrices and
# the auxiliary AdamW group (embeddings, head, norms).
_MATCHED = {"adjust_lr_fn": "match_rms_adamw"}
register_entry(
    CatalogueEntry(
        "muon",
        DistributedMuon,
        recommended=_MATCHED,
        param_groups=muon_param_groups,
        transient=_TRANSIENT,
        demo=Demo("Muon (aux AdamW, AdamW-matched RMS)", 1.4e-2),
    )
)
register_entry(
    CatalogueEntry(
        "normuon",
        DistributedNorMuon,
        recommended=_MATCHED,
        param_groups=muon_param_groups,
        transient=_TRANSIENT,
        demo=Demo("NorMuon (aux AdamW, AdamW-matched RMS)", 1.4e-2),
    )
)
