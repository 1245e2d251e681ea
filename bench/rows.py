"""Benchmark rows of every optimizer and its peers (registered into bench_step.EXTRA_ROWS)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Row:
    name: str
    group: str  # the optimizer family it is compared within
    factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    requires: str | None = None  # import name of an optional package
    # Steps between expensive refreshes that the first step also does (GaLore's SVDs): the
    # amortised step is (first step + (refresh_every - 1) x median step) / refresh_every.
    refresh_every: int | None = None


_ROWS: list[Row] = []


def rows() -> list[Row]:
    """Every benchmark row; the first is the AdamW baseline."""
    return list(_ROWS)


def _cls(path: str) -> Any:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _add(
    name: str,
    group: str,
    factory: Callable[[list[torch.Tensor]], Any],
    requires: str | None = None,
    refresh_every: int | None = None,
) -> None:
    _ROWS.append(Row(name, group, factory, requires, refresh_every))


def _dist(name: str) -> Any:
    import dist_optim

    return getattr(dist_optim, name)


_add("torch AdamW (foreach)", "baseline", lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True))
_add("dist_optim Lamb", "lamb", lambda p: _dist("DistributedLamb")(p, lr=1e-3))
_add("dist_optim Lamb (optim_bits=8)", "lamb", lambda p: _dist("DistributedLamb")(p, lr=1e-3, optim_bits=8))
_add("torch_optimizer Lamb", "lamb", lambda p: _cls("torch_optimizer.Lamb")(p, lr=1e-3), "torch_optimizer")
_add("colossalai Lamb", "lamb", lambda p: _cls("colossalai.nn.optimizer.Lamb")(p, lr=1e-3), "colossalai")
# Adafactor: fixed lr, no relative step, so every implementation does the same work.
_add(
    "dist_optim Adafactor",
    "adafactor",
    lambda p: _dist("DistributedAdafactor")(p, lr=1e-3, relative_step=False, scale_parameter=False),
)
_add(
    "transformers Adafactor",
    "adafactor",
    lambda p: _cls("transformers.optimization.Adafactor")(p, lr=1e-3, relative_step=False, scale_parameter=False),
    "transformers",
)
_add("torch Adafactor", "adafactor", lambda p: torch.optim.Adafactor(p, lr=1e-3))
_add("dist_optim CAME", "came", lambda p: _dist("DistributedCAME")(p, lr=2e-4))
_add("dist_optim CAME (optim_bits=8)", "came", lambda p: _dist("DistributedCAME")(p, lr=2e-4, optim_bits=8))
_add("came_pytorch CAME", "came", lambda p: _cls("came_pytorch.CAME")(p, lr=2e-4), "came_pytorch")
_add("colossalai CAME", "came", lambda p: _cls("colossalai.nn.optimizer.CAME")(p, lr=2e-4), "colossalai")


# Preconditioned from the first step (start=1), so the median is a preconditioned step between
# refreshes and "amortised" adds one root refresh (the first step's) per precondition_frequency
# steps; "before start" is a step before start_preconditioning_step (statistics and grafting only).
def _shampoo(
    pf: int, start: int, packed: bool = False, bits: int = 32, pbits: int = 32, kl: bool = False
) -> Callable[[list[torch.Tensor]], Any]:
    return lambda p: _dist("DistributedShampoo")(
        p,
        lr=1e-3,
        max_preconditioner_dim=1024,
        precondition_frequency=pf,
        start_preconditioning_step=start,
        grafting_config=_dist("AdamGraftingConfig")(beta2=0.999, epsilon=1e-8),
        use_symmetric_packing=packed,
        optim_bits=bits,
        preconditioner_bits=pbits,
        kl_statistics=kl,
    )


for _pf in (1, 10, 100):
    _add(f"dist_optim Shampoo pf={_pf}", "shampoo", _shampoo(_pf, 1), refresh_every=_pf)
# Factors and roots as packed triangles: the same steps bit for bit, the cost of
# unpacking each block's matrices into scratch and packing the changed ones back; then with the
# moments and grafting state in 8 bits too.
_add("dist_optim Shampoo pf=10 (packed)", "shampoo", _shampoo(10, 1, True), refresh_every=10)
_add("dist_optim Shampoo pf=10 (packed, optim_bits=8)", "shampoo", _shampoo(10, 1, True, 8), refresh_every=10)
# And the roots as 4-bit eigenvectors with fp32 eigenvalues: every preconditioned
# step dequantises them, takes one Björck step and makes the roots again (three products per factor).
_add(
    "dist_optim Shampoo pf=10 (packed, optim_bits=8, preconditioner_bits=4)",
    "shampoo",
    _shampoo(10, 1, True, 8, 4),
    refresh_every=10,
)
_add(
    "dist_optim Shampoo pf=10 (packed, optim_bits=8, preconditioner_bits=8)",
    "shampoo",
    _shampoo(10, 1, True, 8, 8),
    refresh_every=10,
)
_add("dist_optim Shampoo before start", "shampoo", _shampoo(10_000, 10_000))
# KL-Shampoo: each factor's statistic from the gradient times the other factor's root, one more
# product per factor and step than Shampoo's.
_add("dist_optim KL-Shampoo pf=10", "shampoo", _shampoo(10, 1, kl=True), refresh_every=10)
_add("dist_optim Kron", "kron", lambda p: _dist("DistributedKron")(p, lr=3e-4, seed=0))
_add("dist_optim Kron (optim_bits=8)", "kron", lambda p: _dist("DistributedKron")(p, lr=3e-4, seed=0, optim_bits=8))
_add(
    "dist_optim Kron (packed, optim_bits=8)",
    "kron",
    lambda p: _dist("DistributedKron")(p, lr=3e-4, seed=0, optim_bits=8, use_symmetric_packing=True),
)
# Triangular factors in 8-bit codes too: dequantised for every step, quantised back with
# stochastic rounding after each fit.
_add(
    "dist_optim Kron (packed, optim_bits=8, preconditioner_bits=8)",
    "kron",
    lambda p: _dist("DistributedKron")(
        p, lr=3e-4, seed=0, optim_bits=8, use_symmetric_packing=True, preconditioner_bits=8
    ),
)
_add("kron_torch Kron", "kron", lambda p: _cls("kron_torch.Kron")(p, lr=3e-4), "kron_torch")


def _galore_groups(params: list[torch.Tensor], rank: int = 128, gap: int = 200) -> list[dict[str, Any]]:
    """GaLore on the matrices that have both dims >= rank (the attention/MLP weights of the set)."""
    mats = [p for p in params if p.dim() == 2 and min(p.shape) >= rank and p.shape[0] != 8192]
    others = [p for p in params if all(p is not m for m in mats)]
    return [
        {"params": others},
        {"params": mats, "rank": rank, "update_proj_gap": gap, "scale": 0.25, "proj_type": "std"},
    ]


_GAP = 200
# Not the baseline (ratios are to foreach, the form the targets were set against): shown so that a
# reader sees how much faster torch's one-pass kernel is here; GaLore's plain parameters use it.
_add("torch AdamW (fused)", "galore", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True))
_add(
    "dist_optim GaLore 32-bit",
    "galore",
    lambda p: _dist("DistributedGaLore")(_galore_groups(p), lr=1e-3),
    refresh_every=_GAP,
)
_add(
    "dist_optim GaLore 8-bit",
    "galore",
    lambda p: _dist("DistributedGaLore")(_galore_groups(p), lr=1e-3, optim_bits=8),
    refresh_every=_GAP,
)
_add(
    "galore_torch GaLoreAdamW",
    "galore",
    lambda p: _cls("galore_torch.GaLoreAdamW")(_galore_groups(p), lr=1e-3),
    "galore_torch",
    refresh_every=_GAP,
)


def muon_groups(params: list[torch.Tensor], vocab: tuple[int, ...] = (8192, 4096)) -> list[dict[str, Any]]:
    """Hidden matrices to Muon; the embedding and the vectors to its AdamW (the usual split)."""
    mats = [p for p in params if p.dim() == 2 and p.shape[0] not in vocab]
    others = [p for p in params if all(p is not m for m in mats)]
    return [{"params": mats}, {"params": others, "use_muon": False, "lr": 1e-3}]


def _plain_muon(params: list[torch.Tensor]) -> Any:
    from bench.plain_muon import PlainMuon

    return PlainMuon(muon_groups(params), lr=2e-3, wd=0.01)


_add("dist_optim Muon", "muon", lambda p: _dist("DistributedMuon")(muon_groups(p), lr=2e-3, weight_decay=0.01))
_add(
    "dist_optim Muon (ns_gram_space=True)",
    "muon",
    lambda p: _dist("DistributedMuon")(muon_groups(p), lr=2e-3, weight_decay=0.01, ns_gram_space=True),
)
_add(
    "dist_optim Muon (optim_bits=8)",
    "muon",
    lambda p: _dist("DistributedMuon")(muon_groups(p), lr=2e-3, weight_decay=0.01, optim_bits=8),
)
_add("plain Muon (bench/plain_muon.py)", "muon", _plain_muon)
_add(
    "dist_optim NorMuon",
    "normuon",
    lambda p: _dist("DistributedNorMuon")(muon_groups(p), lr=2e-3, weight_decay=0.01),
)
