"""Muon: momentum orthogonalized by Newton-Schulz (K. Jordan et al., 2024, "Muon: An optimizer for
hidden layers in neural networks", kellerjordan.github.io/posts/muon; scaled up in J. Liu et al.,
2025, "Muon is Scalable for LLM Training", arXiv:2502.16982), with an AdamW for the parameters that
are not hidden matrices, in one optimizer.

For a matrix ``W`` of shape ``m x n`` (a parameter with more dims is seen as
``shape[0] x prod(shape[1:])``, e.g. a conv weight, or with ``stacked=True`` as ``shape[0]``
matrices ``shape[1] x prod(shape[2:])``: experts or heads stored in one tensor) with gradient
``G`` (``t`` = 1-based step)::

    B <- momentum * B + G                       (momentum_ema: B <- lerp(B, G, 1 - momentum))
    C  = G + momentum * B if nesterov else B    (momentum_ema: C = lerp(G, B, momentum);
                                                 nesterov_sum: C = G + B)
    X  = C / max(||C||_F, eps)                  (eps_form="add": C / (||C||_F + eps)), transposed if m > n
    ns_steps times (or once per triple of a coefficient schedule):
        A = X X^T;  X <- a X + (b A + c A A) X
    X transposed back
    W <- W (1 - lr * weight_decay)
    W <- W - lr' X,   lr' = lr * sqrt(max(1, m / n))       (adjust_lr_fn None / "original")
                      lr' = 0.2 * lr * sqrt(max(m, n))     ("match_rms_adamw", Liu et al.)

The iteration runs in ``ns_dtype`` (default: the parameter's dtype), in fp32/fp64 with its
symmetric products computed blockwise, and with ``ns_gram_space=True`` for wide matrices in Gram
space in any dtype (fewer flops, somewhat less accurate: :mod:`dist_optim.kernels.newton_schulz`), the
other matrices then blockwise in bfloat16/float16 too. The defaults and the sum form
of the momentum are ``torch.optim.Muon``'s documented algorithm. Two variants exist for exact
conversions (:func:`dist_optim.convert`):

* ``momentum_ema=True``: the momentum as an exponential moving average, as KellerJordan's ``muon``
  package and torch's implementation (torch >= 2.9) compute it (their documentation states the
  sum). ``C`` is then ``(1 - momentum)`` times the sum form's, so the update is the same up to
  ``eps`` (the normalisation removes the scale); the state differs by that factor.
* ``eps_form="add"``: KellerJordan's normalisation ``C / (||C|| + eps)``.
* ``nesterov_sum=True``: ``C = G + B``, heavyball's ``nesterov_ema`` (with ``momentum_ema``): the
  gradient weighs ``1 / momentum`` times more against the average than in the interpolation, so
  the direction differs, not only its scale.

Parameter groups with ``use_muon=False`` get AdamW (decoupled weight decay, bias-corrected,
``adamw_betas``, ``adamw_eps``, the group's own ``lr`` and ``weight_decay``; torch's fused kernel
where it applies; with ``optim_bits=8`` 8-bit moments as bitsandbytes' AdamW8bit, :mod:`.adamw`), as
KellerJordan's ``MuonWithAuxAdam``. :func:`muon_param_groups` builds the
usual split from a model. A parameter with fewer than 2 dims in a Muon group is a ``ValueError``
(raised when the optimizer is bound or first steps: under ZeRO the optimizer's parameters are flat
chunks, so only their layouts tell their shapes).

Deviations: a parameter without a gradient is skipped (torch's behaviour; KellerJordan's packages
step it with a zero gradient, decaying its momentum and weights); a NaN/Inf gradient raises or
skips the step under the ``nonfinite`` policy shared by every dist_optim optimizer
(:class:`~dist_optim.base.DistOptimizer`).

Distribution (TP slices, ZeRO chunks, data-parallel replicas): the momentum and ``C`` are element-
wise, so every rank keeps the momentum of the elements it holds (no full-size state anywhere) and
computes its part of ``C``. Each matrix (a parameter: its full tensor, whatever TP split it or ZeRO
cut it) has one *owner* rank in its work group, the TP x data-parallel grid of the ranks that hold
pieces of it, chosen by the iteration's cost (:func:`newton_schulz_flops`), through the owner
interface every owner-computing optimizer shares (:mod:`dist_optim.sharding.owners`). Every rank sends its
pieces of ``C`` straight to the matrix's owner (each slice's owner with ``stacked``), the owner
runs the iteration on the whole matrix, and sends the pieces of ``X`` back to every rank that holds
them (:func:`owners.to_owners` / :func:`owners.from_owners`: one ``all_to_all`` per work group and
direction for all matrices of a step, in ``communication_dtype``, default the parameters' dtype; a
matrix every rank holds whole, under DDP, is not sent: its owner has it). Each rank then updates
its own elements. A step issues these two collectives per work group (one, the way back, where
every rank holds every matrix whole) plus the NaN/Inf check's flag all-reduce: 3 with one work
group of pieces. Where pieces cannot be routed (holdings that do not tile the matrix;
``OwnerRuntime.route_pieces = False``, :mod:`dist_optim.sharding.runtime`) the full ``C`` is gathered, the
owners iterate and share ``X`` whole (:func:`dist_optim.sharding.owners.share_results`). The matrix
orthogonalized is the single-device run's, so the result is the single-device result (fp32
communication: the same bits up to the iteration's own rounding, which is the same computation
on the same matrix). AdamW groups are element-wise and need no communication.

What is one matrix: the single-device run's parameter. A TP layout that interleaves a fused QKV
weight (each rank holding its q, k and v rows) assembles a row permutation of it, and Newton-Schulz
commutes with permutations of rows and columns (``f(P X Q) = P f(X) Q`` for the iteration, the
norm and the shape), so the result is the single-device one. Pipeline stages own their matrices
(each stage's data-parallel groups and grids are its work groups); MoE experts are split over
their expert data-parallel group, the group that shards them. Experts or heads stacked in one
tensor: ``stacked=True``.

QK-clip (``qk_clip_tau``, Kimi K2's MuonClip): the attention heads whose logits exceeded a bound
in the step are scaled back after it, each TP rank on its own heads (:mod:`.qk_clip`).
"""

from __future__ import annotations

from ..kernels.newton_schulz import newton_schulz, newton_schulz_flops
from . import (
    conversions,  # noqa: F401  (registers the conversions and the planner entry)
    heavyball,  # noqa: F401  (registers heavyball's conversions)
)
from .coefficients import DEFAULT_NS_COEFFICIENTS
from .groups import DEFAULT_HEAD_NAMES, muon_param_groups
from .normuon import DistributedNorMuon
from .optimizer import ADJUST_LR_FNS, EPS_FORMS, DistributedMuon, adjusted_lr
from .qk_clip import watch_attention_logits

__all__ = [
    "DistributedMuon",
    "DistributedNorMuon",
    "muon_param_groups",
    "watch_attention_logits",
    "newton_schulz",
    "newton_schulz_flops",
    "adjusted_lr",
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_HEAD_NAMES",
    "ADJUST_LR_FNS",
    "EPS_FORMS",
]
