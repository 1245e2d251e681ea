"""PSGD Kron: preconditioned SGD with Kronecker-factored preconditioners, exact under TP and ZeRO.

References:

* Xi-Lin Li, "Preconditioned stochastic gradient descent", arXiv:1512.04202, 2015 (PSGD, the
  preconditioner fitting criterion, Kronecker-product preconditioners).
* Xi-Lin Li, "Preconditioner on matrix Lie group for SGD", arXiv:1809.10232, 2018 (fitting the
  factors on the group of invertible upper-triangular matrices, normalised step sizes).
* Evan Walters, Omead Pooladzandi, Xi-Lin Li, "Distributed PSGD Kron" (JAX, the seed this module
  follows) and the ``kron-torch`` package (``kron_torch.kron.Kron``, 0.3.3), whose single-device
  algorithm this module reproduces.

The algorithm, per parameter tensor with gradient ``g`` (shape merged as below)::

    m <- b1 m + (1 - b1) g                        momentum
    G  = m / (1 - b1^t)                           debiased; (or g with momentum_into_precond_update=False)
    on a preconditioner-update step:
        V ~ N(0, 1) like G;  G <- G + sqrt(eps_f32) * mean|G| * V
        A = (Q_1 (x) ... (x) Q_d) G               (Q_k applied along dim k)
        B = (Q_1^-T (x) ... (x) Q_d^-T) V
        for every factor k (all from the same A, B):
            T1 = A_(k) A_(k)^T,  T2 = B_(k) B_(k)^T  (diagonal factors: only the diagonals)
            triangular:  Q_k <- Q_k - precond_lr * triu(T1 - T2) / max(lb||T1 + T2||_2, tiny) Q_k
            diagonal:    Q_k <- Q_k - precond_lr * (T1 - T2) / max(max|T1 + T2|, tiny) * Q_k
    u  = (Q_1^T Q_1 (x) ... (x) Q_d^T Q_d) G      preconditioned direction
    u *= min(1, 1.1 / (rms(u) + 1e-12))           update RMS clipping
    w <- w - lr (u + weight_decay w)              (weight decay only for tensors with >= 2 dims)

``lb`` is a cheap lower bound of the spectral norm (one power-iteration step from the column of
largest norm). This is the whitening ("gg^T") fit of PSGD: Q^T Q tends to E[g g^T]^{-1/2}.

Factor structure (as kron_torch): a dim gets a diagonal factor when its size is 1 or exceeds
``max_size_triangular``, when the tensor has fewer than ``min_ndim_triangular`` dims, or by
``memory_save_mode`` ("one_diag": the largest dim, the last of equal largest ones; "all_diag":
all; "smart_one_diag": the largest only if strictly larger than the second); otherwise an upper
triangular one. Factors start at ``precond_init_scale ** (1 / ndim)`` times identity. With
``merge_dims`` a tensor of more than 2 dims is preconditioned as the matrix ``[prod(s[:-1]),
s[-1]]`` or ``[s[0], prod(s[1:])]`` that kron_torch picks. On preconditioner-update steps where a
seeded draw is below 0.01, the factors are first rescaled to equal max-abs (their product is
unchanged): kron_torch's "balancing".

Update decision (as kron_torch 0.3.3, not the seed's coin flip): the probability ``p`` of step
``n`` (a float, or a callable of the step count ``n = 0, 1, ...``; default the annealing schedule
:func:`precond_update_prob_schedule`: 1.0 for 500 steps, then ``exp(-0.001 (n - 500))`` down to
0.03) drives a counter: the preconditioner is updated when the number of steps since the last
update reaches ``1 / p``. This is deterministic, so every rank takes the same decision without
communicating. Randomness: by default (``probe_rng="sequential"``) the probe vectors ``V`` come
from a ``torch.Generator`` seeded with ``seed`` and drawn for every parameter with a gradient, in
``param_groups`` order, on every rank (non-owners draw and discard), so every rank's generator
stays in step. That stream depends on which parameters an optimizer holds, so a pipeline stage
would draw other numbers than a single device: ``probe_rng="per_parameter"`` seeds each probe
from ``(seed, parameter name, parameter step)`` instead (the dist_optim plugins switch to it
under pipeline parallelism). The balancing draw comes from ``random.Random(seed)``, drawn once
per step as kron_torch does (every stage takes the same decisions).

Deviations from ``kron_torch.kron.Kron``:

* ``V`` comes from the optimizer's own generator (``seed``, default 42), not the global torch
  generator; with ``torch.manual_seed(seed)`` before kron_torch's first step and no other use of
  the global generator in between, both draw the same numbers. The balancing draw uses
  ``random.Random(seed)``, kron_torch always ``random.Random(42)``: identical for the default seed.
* The step count passed to a custom schedule is a Python int (kron_torch: a float32 tensor).
* ``momentum_buffer`` is kept in the parameter's shape (kron_torch: the merged shape); the
  factors are state keys ``Q_0, Q_1, ...`` (kron_torch: a list ``Q`` plus einsum strings);
  ``step`` is a CPU float tensor (torch's convention).
* kron_torch mutates ``p.grad`` in place (adds the probe noise) with
  ``momentum_into_precond_update=False``; we do not touch gradients. kron_torch prints buffer
  sizes on the first step; we do not.
* The contractions are written as matrix products along one dim at a time instead of einsum,
  and they skip what the structure makes known (:mod:`dist_optim.structured`: the zero half of
  the upper-triangular factors, the mirrored half of the Gram matrices): the same math, fp32
  rounding differs (~1e-7 relative), about a third of the multiply-adds of a large factor.
* ``clip_update_rms`` (default True) can switch the RMS clipping off, as in kron_torch's
  DistributedKron.

Distribution. Preconditioners are functions of the *full* tensor, so each parameter has one
owner rank among the ranks that hold pieces of it: its work group (:mod:`dist_optim.owners`: the
TP x data-parallel grid of its ZeRO group, or of the data-parallel group; assigned once at bind
time by :func:`dist_optim.owners.assign` with the cost model :func:`precond_cost`). The owner keeps
the factors. Per step:

1. every rank updates its local piece of the momentum (elementwise, exact);
2. every rank sends its pieces of each momentum (and of the gradient with
   ``momentum_into_precond_update=False``) straight to the parameter's owner, which assembles the
   whole tensor (:func:`dist_optim.owners.to_owners`: one all_to_all per work group for all its
   parameters; a tensor every rank holds whole, replicated, is not sent: its owner has it);
3. the owner debiases, updates its factors, preconditions and clips, on the whole tensor exactly
   as a single device does;
4. the owner sends every rank that holds a piece of the parameter that piece of the direction
   (:func:`dist_optim.owners.from_owners`: one all_to_all per work group);
5. each rank applies weight decay and the step to its own elements.

Which piece goes where is planned once per binding, at the first step (one all_gather_object per
work group, :func:`dist_optim.owners.plan_routes`). So a step issues the NaN/Inf check's flag
before anything changes (one all-reduce over the job and one host read, unless
``nonfinite="ignore"``; see :class:`~dist_optim.base.DistOptimizer`) plus one all_to_all each way
per work group (only the way back where every rank holds every tensor whole), whatever the number
of parameters. No rank holds a full momentum or direction it does not own: a rank receives the
whole momenta it owns and its pieces of the directions (about a quarter of gathering every full
momentum and direction at ZeRO x 4). ``communication_dtype`` (default: fp32, exact; otherwise the
widest of the tensors' dtypes) sets the precision of both exchanges; a rank's pieces to itself go
through it too (:func:`dist_optim.comm.exchange`), so the owner applies exactly what the other
holders receive and replicas cannot drift apart. A parameter replicated across the TP group is
owned on the TP x data grid too (its TP replicas hold the same gradient); where no grid could be
made (or a parameter's TP group is not the optimizer's), the TP replicas compute it redundantly.
Where no route exists (unbound, a work group of one, holdings that do not tile the tensor, or
``route_pieces=False``) every rank gathers the full momentum (:func:`dist_optim.comm.gather_full`,
one all_gather per ZeRO/TP group) and receives the owner's full direction
(:func:`dist_optim.owners.share_results`, one all_gather per work group): the same result, bit
for bit in fp32. :meth:`DistributedKron.full_state` returns every factor in full on every rank.

Limitations: the owner holds the whole momentum, direction and fit temporaries of the parameters
it owns, and with ``probe_rng="sequential"`` every rank draws (and non-owners discard) a full-size
probe for every parameter on update steps, one at a time, so that every generator stays in step;
under MoE without ZeRO, expert parameters would be owned across the plain data-parallel group,
which spans different experts (pass ``zero_group_of``/use ZeRO).
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..base import DistOptimizer, check_range
from ..comm import gather_full, ordered_groups, widest_dtype
from ..layout import Box
from ..owners import (
    Owner,
    assign,
    data_group,
    from_owners,
    plan_routes,
    share_results,
    to_owners,
    work_grids,
    work_group,
)
from ..registry import Conversion, PlanEntry, register, register_plan
from ..structured import gram, matmul_triangular, upper_times_upper
from ..work import Route

__all__ = ["DistributedKron", "ProbabilitySchedule", "precond_update_prob_schedule", "precond_cost"]

MEMORY_SAVE_MODES = (None, "smart_one_diag", "one_diag", "all_diag")
PROBE_RNGS = ("sequential", "per_parameter")
_BALANCE_PROBABILITY = 0.01
_CLIP_RMS = 1.1


# ---- update-probability schedule ----------------------------------------------------------------
@dataclass(frozen=True)
class ProbabilitySchedule:
    """Exponential anneal with a flat start: ``clamp(max_prob * exp(-decay * (n - flat_start)),
    min_prob, max_prob)`` at step ``n`` (computed in fp32, like kron_torch's ``ProbScheduler``)."""

    max_prob: float = 1.0
    min_prob: float = 0.03
    decay: float = 0.001
    flat_start: float = 500.0

    def __post_init__(self) -> None:
        check_range("max_prob", self.max_prob, 0.0, 1.0, closed_high=True)
        check_range("min_prob", self.min_prob, 0.0, 1.0, closed_high=True)
        if self.min_prob <= 0 or self.max_prob <= 0:
            raise ValueError(f"max_prob and min_prob must be in (0, 1], got {self.max_prob}, {self.min_prob}")
        check_range("decay", self.decay, 0.0)

    def __call__(self, n: int | float | torch.Tensor) -> torch.Tensor:
        f32 = torch.float32
        step = torch.as_tensor(n, dtype=f32)
        prob = torch.tensor(self.max_prob, dtype=f32) * torch.exp(
            -torch.tensor(self.decay, dtype=f32) * (step - torch.tensor(self.flat_start, dtype=f32))
        )
        return prob.clamp(min=torch.tensor(self.min_prob, dtype=f32), max=torch.tensor(self.max_prob, dtype=f32))


def precond_update_prob_schedule(
    max_prob: float = 1.0, min_prob: float = 0.03, decay: float = 0.001, flat_start: float = 500
) -> ProbabilitySchedule:
    """The default preconditioner-update schedule of the seed and kron_torch: probability 1 for
    ``flat_start`` steps, then an exponential decay to ``min_prob`` (about 4000 steps with the
    defaults)."""
    return ProbabilitySchedule(float(max_prob), float(min_prob), float(decay), float(flat_start))


# ---- per-parameter plan: merged shape and factor kinds ------------------------------------------
@dataclass(frozen=True)
class _Plan:
    shape: tuple[int, ...]  # the (merged) full shape the preconditioner acts on
    diag: tuple[bool, ...]  # per dim: diagonal (True) or upper-triangular factor

    def factor_shapes(self) -> list[tuple[int, ...]]:
        if not self.shape:
            return [()]
        return [(n,) if d else (n, n) for n, d in zip(self.shape, self.diag)]


def _merged_shape(shape: tuple[int, ...], merge: bool) -> tuple[int, ...]:
    """kron_torch's choice for > 2 dims: ``[prod(s[:-1]), s[-1]]`` unless ``[s[0], prod(s[1:])]``
    has the smaller signed difference (second minus first)."""
    if len(shape) <= 2 or not merge:
        return shape
    last = (math.prod(shape[:-1]), shape[-1])
    first = (shape[0], math.prod(shape[1:]))
    return last if last[1] - last[0] <= first[1] - first[0] else first


def _diag_dims(shape: tuple[int, ...], memory_save_mode: str | None, max_size: int, min_ndim: int) -> tuple[bool, ...]:
    ndim = len(shape)
    diag = [False] * ndim
    if ndim:
        # The largest dim; among equal largest ones the last (numpy's reversed argsort on <= 13 items).
        largest = max(range(ndim), key=lambda i: (shape[i], i))
        if memory_save_mode == "all_diag":
            diag = [True] * ndim
        elif memory_save_mode == "one_diag":
            diag[largest] = True
        elif memory_save_mode == "smart_one_diag":
            ordered = sorted(shape)
            if ndim > 1 and ordered[-1] > ordered[-2]:
                diag[largest] = True
    return tuple(d or n == 1 or n > max_size or ndim < min_ndim for n, d in zip(shape, diag))


def _make_plan(full_shape: tuple[int, ...], group: dict[str, Any]) -> _Plan:
    shape = _merged_shape(tuple(full_shape), bool(group["merge_dims"]))
    if len(shape) > 13:
        raise ValueError(f"DistributedKron: a {len(shape)}-dim parameter is not supported (at most 13 dims)")
    diag = _diag_dims(shape, group["memory_save_mode"], group["max_size_triangular"], group["min_ndim_triangular"])
    return _Plan(shape, diag)


def precond_cost(shape: Sequence[int], diag: Sequence[bool]) -> float:
    """Work of one preconditioner update plus preconditioning, in multiply-adds (a model).

    Per triangular factor of size ``n`` on a tensor of ``N`` elements, with the structured
    products of :mod:`dist_optim.structured`: ``A`` and the triangular solve ~N n / 2 each, the
    two Gram products ~N n / 2 each, the two triangular applications in the preconditioning
    ~N n / 2 each (3 N n together), the factor update ``triu(D) Q`` ~n^3 / 3. A diagonal factor
    costs ~8 N."""
    numel = math.prod(shape)
    cost = float(numel)
    for n, d in zip(shape, diag):
        cost += 8.0 * numel if d else 3.0 * numel * n + float(n) ** 3 / 3.0
    return cost


# ---- the math on full tensors (owner side) -------------------------------------------------------
def _times_upper_t(rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``rows @ q.T`` for an upper-triangular ``q`` (only the triangle is read: half the flops)."""
    return matmul_triangular(rows, q.T, upper=False)


def _times_upper_t_upper(rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``rows @ q.T @ q`` for an upper-triangular ``q``."""
    return matmul_triangular(matmul_triangular(rows, q.T, upper=False), q)


def _along(t: torch.Tensor, dim: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Apply ``fn`` to the rows of ``t`` seen as a matrix whose columns index ``dim``."""
    moved = t.movedim(dim, -1)
    shape = moved.shape
    out = fn(moved.reshape(-1, shape[-1])).reshape(shape)
    return out.movedim(-1, dim)


def _scale_along(t: torch.Tensor, dim: int, vec: torch.Tensor) -> torch.Tensor:
    view = [1] * t.dim()
    view[dim] = vec.numel()
    return t * vec.view(view)


def _apply_factors(t: torch.Tensor, factors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(Q_1 (x) ... (x) Q_d) t``: each factor applied to the vectors along its dim."""
    for dim, q in enumerate(factors):
        if q.dim() < 2:
            t = _scale_along(t, dim, q)
        else:
            t = _along(t, dim, functools.partial(_times_upper_t, q=q))
    return t


def _apply_inverse_transposed(t: torch.Tensor, factors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(Q_1^-T (x) ... (x) Q_d^-T) t`` by triangular solves (in fp32)."""
    for dim, q in enumerate(factors):
        if q.dim() < 2:
            t = _scale_along(t, dim, q.reciprocal())
        else:
            # A row r of the moved tensor becomes r Q^-1, i.e. the column Q^-T r^T.
            def solve(rows: torch.Tensor, q: torch.Tensor = q) -> torch.Tensor:
                out = torch.linalg.solve_triangular(q.float(), rows.float(), upper=True, left=False)
                return out.to(q.dtype)

            t = _along(t, dim, solve)
    return t


def _gram(t: torch.Tensor, dim: int, diagonal: bool) -> torch.Tensor:
    """Contraction of ``t`` with itself over every dim but ``dim``: the matrix ``T T^T`` of its
    mode-``dim`` unfolding ``T``, or only its diagonal."""
    rows = t.movedim(dim, 0).reshape(t.shape[dim], -1)
    return (rows * rows).sum(1) if diagonal else gram(rows)


def _spectral_lower_bound(sym: torch.Tensor, max_abs: torch.Tensor) -> torch.Tensor:
    """A cheap lower bound of the spectral norm of a symmetric matrix: one power-iteration step
    started from its column of largest norm (computed on ``sym / max_abs`` for range)."""
    scaled = sym / max_abs
    col = torch.argmax((scaled * scaled).sum(0))
    x = scaled.index_select(1, col.reshape(1)).reshape(-1) @ scaled
    x = x / x.norm()
    return (scaled @ x).norm() * max_abs


def _update_factors(
    factors: list[torch.Tensor], g: torch.Tensor, v: torch.Tensor, precond_lr: float, tiny: torch.Tensor
) -> None:
    """One step of the whitening fit on the Lie group (Li 2018), in place. ``g`` already carries
    the probe noise; every factor's step uses the ``A``/``B`` of the factors before the step."""
    a = _apply_factors(g, factors)
    b = _apply_inverse_transposed(v, factors)
    lr = torch.tensor(precond_lr, dtype=g.dtype, device=g.device)
    for dim, q in enumerate(factors):
        diagonal = q.dim() < 2
        ga, gb = _gram(a, dim, diagonal), _gram(b, dim, diagonal)
        diff, total = (ga - gb) * lr, ga + gb
        max_abs = total.abs().max()
        if diagonal:
            q.sub_(diff * q / max_abs.clamp(min=tiny))
        else:
            bound = torch.where(max_abs > 0, _spectral_lower_bound(total, max_abs), max_abs).clamp(min=tiny)
            # Only diff's upper triangle enters: triu(diff) @ Q with Q upper triangular.
            q.sub_(upper_times_upper(diff.div_(bound), q))


def _update_scalar_factor(
    q: torch.Tensor, g: torch.Tensor, v: torch.Tensor, precond_lr: float, tiny: torch.Tensor
) -> None:
    a, b = q * g, v / q
    ga, gb = a * a, b * b
    lr = torch.tensor(precond_lr, dtype=g.dtype, device=g.device)
    q.sub_((ga - gb) * lr * q / (ga + gb).abs().clamp(min=tiny))


def _balance(factors: list[torch.Tensor]) -> None:
    """Rescale the factors to a common max-abs (their geometric mean); the product is unchanged."""
    norms = torch.stack([q.abs().max() for q in factors])
    target = norms.log().mean().exp()
    torch._foreach_mul_(factors, list((target / norms).unbind()))


def _precondition(factors: Sequence[torch.Tensor], g: torch.Tensor) -> torch.Tensor:
    """``(Q_1^T Q_1 (x) ... (x) Q_d^T Q_d) g``."""
    if g.dim() == 0:
        return factors[0] * factors[0] * g
    for dim, q in enumerate(factors):
        if q.dim() < 2:
            g = _scale_along(g, dim, q * q)
        else:
            g = _along(g, dim, functools.partial(_times_upper_t_upper, q=q))
    return g.contiguous()


def _clip_rms(u: torch.Tensor) -> torch.Tensor:
    rms = u.square().mean().sqrt()
    return u.mul_(torch.clamp(_CLIP_RMS / (rms + 1e-12), max=1.0))


class DistributedKron(DistOptimizer):
    """PSGD Kron (Li 2015, 2018; kron_torch's ``Kron``), exact under TP and ZeRO (see the module
    docstring for the algorithm, the distribution and the deviations from kron_torch).

    Args:
        params: parameters or parameter groups.
        lr: learning rate (>= 0); the seed's advice is ~3x smaller than Adam's, hence 3e-4.
        b1: momentum coefficient in [0, 1).
        weight_decay: decoupled weight decay, applied to tensors of >= 2 dims only (>= 0).
        preconditioner_update_probability: a float in (0, 1], a callable ``step -> probability``,
            or None for :func:`precond_update_prob_schedule`. Read from the first group.
        max_size_triangular: dims larger than this get diagonal factors.
        min_ndim_triangular: tensors with fewer dims get only diagonal factors.
        memory_save_mode: None, "smart_one_diag", "one_diag" or "all_diag".
        momentum_into_precond_update: fit the preconditioner to the debiased momentum (True) or
            to the raw gradient.
        precond_lr: step size of the factor updates (>= 0).
        precond_init_scale: initial scale of the preconditioner (> 0).
        merge_dims: precondition tensors of > 2 dims as matrices.
        mu_dtype: dtype of the momentum (default: the parameter's).
        precond_dtype: dtype of the factors (default fp32).
        clip_update_rms: clip the RMS of the preconditioned direction at 1.1.
        seed: seed of the generators (probe vectors and balancing). Every rank must use the same.
        communication_dtype: precision of the exchanges with the owners when bound (default: the
            widest dtype of the tensors sent, fp32 = exact; ``torch.bfloat16`` halves the bytes at
            bf16 rounding of momenta and directions).
        probe_rng: where the probe vectors come from. ``"sequential"`` (default, kron_torch's):
            one generator drawn for every parameter with a gradient in ``param_groups`` order,
            on every rank. ``"per_parameter"``: each probe from a generator seeded by ``(seed,
            parameter key, the parameter's step)``, where the key is the parameter's name in
            ``param_names`` (set by the dist_optim plugins at boost) or else its position in
            ``param_groups``: the same probes whatever subset of the model an optimizer holds, so
            a pipeline stage reproduces the single-device run, and only owners draw.
        nonfinite: a step with a NaN/Inf gradient ``"raise"`` (default), ``"skip"`` or
            ``"ignore"`` (see :class:`~dist_optim.base.DistOptimizer`); a skipped step draws no
            random numbers and leaves the update schedule where it was.
    """

    _sharded_state = ("momentum_buffer",)

    #: Route the pieces of each momentum to its owner and the pieces of its direction back to
    #: their holders (one all_to_all per work group each way). False: every rank gathers every
    #: full momentum and receives every full direction (the fallback path; kept to compare).
    route_pieces: bool = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 3e-4,
        b1: float = 0.9,
        weight_decay: float = 0.0,
        preconditioner_update_probability: float | Callable[[int], Any] | None = None,
        max_size_triangular: int = 8192,
        min_ndim_triangular: int = 2,
        memory_save_mode: str | None = None,
        momentum_into_precond_update: bool = True,
        precond_lr: float = 0.1,
        precond_init_scale: float = 1.0,
        merge_dims: bool = True,
        mu_dtype: torch.dtype | None = None,
        precond_dtype: torch.dtype | None = None,
        clip_update_rms: bool = True,
        seed: int = 42,
        communication_dtype: torch.dtype | None = None,
        probe_rng: str = "sequential",
        *,
        nonfinite: str = "raise",
    ) -> None:
        if probe_rng not in PROBE_RNGS:
            raise ValueError(f"probe_rng must be one of {PROBE_RNGS}, got {probe_rng!r}")
        if preconditioner_update_probability is None:
            preconditioner_update_probability = precond_update_prob_schedule()
        defaults = dict(
            lr=lr,
            b1=b1,
            weight_decay=weight_decay,
            preconditioner_update_probability=preconditioner_update_probability,
            max_size_triangular=max_size_triangular,
            min_ndim_triangular=min_ndim_triangular,
            memory_save_mode=memory_save_mode,
            momentum_into_precond_update=bool(momentum_into_precond_update),
            precond_lr=precond_lr,
            precond_init_scale=precond_init_scale,
            merge_dims=bool(merge_dims),
            mu_dtype=mu_dtype,
            precond_dtype=precond_dtype,
            clip_update_rms=bool(clip_update_rms),
        )
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if communication_dtype not in (None, torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"communication_dtype must be None or a float dtype, got {communication_dtype!r}")
        super().__init__(params, defaults, nonfinite=nonfinite)
        self.seed = seed
        self.communication_dtype = communication_dtype
        self.probe_rng = probe_rng
        self._prob_step = 0
        self._update_counter = 0
        self._balance_rng = random.Random(seed)
        self._generators: dict[torch.device, torch.Generator] = {}
        self._plans: dict[torch.Tensor, _Plan] = {}
        self._owners: dict[torch.Tensor, Owner] = {}
        # Planned lazily from step() (collective over each work group), reset at each (re)binding.
        self._routes: dict[torch.Tensor, Route | None] | None = None

    def validate_group(self, group: dict[str, Any]) -> None:
        """The options of one param group (see the class docstring for their ranges)."""
        super().validate_group(group)
        check_range("lr", group["lr"], 0.0)
        check_range("b1", group["b1"], 0.0, 1.0)
        check_range("weight_decay", group["weight_decay"], 0.0)
        check_range("precond_lr", group["precond_lr"], 0.0)
        check_range("precond_init_scale", group["precond_init_scale"], 0.0)
        if group["precond_init_scale"] <= 0:
            raise ValueError(f"precond_init_scale must be > 0, got {group['precond_init_scale']}")
        for name in ("max_size_triangular", "min_ndim_triangular"):
            value = group[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if group["memory_save_mode"] not in MEMORY_SAVE_MODES:
            raise ValueError(f"memory_save_mode must be one of {MEMORY_SAVE_MODES}, got {group['memory_save_mode']!r}")
        _check_probability(group["preconditioner_update_probability"])
        for name in ("mu_dtype", "precond_dtype"):
            value = group[name]
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"{name} must be None or a floating-point torch.dtype, got {value!r}")

    # ---- plans and owners ---------------------------------------------------------------------
    def _group_of(self, param: torch.Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise KeyError("parameter is not in this optimizer")

    def _plan(self, param: torch.Tensor, group: dict[str, Any] | None = None) -> _Plan:
        plan = self._plans.get(param)
        if plan is None:
            plan = _make_plan(self.layout(param).full_shape, group or self._group_of(param))
            self._plans[param] = plan
        return plan

    def _on_bind(self) -> None:
        """Give every parameter an owner in its work group (:func:`dist_optim.owners.work_group`:
        the TP x data grid), balancing :func:`precond_cost` with :func:`dist_optim.owners.assign`;
        computed once. Collective over the job under TP (the grids are process groups)."""
        self._plans = {}
        params_groups = [(p, g) for g in self.param_groups for p in g["params"]]
        layouts = [self.layout(p) for p, _ in params_groups]
        grids = work_grids(self.tp_group, [data_group(lay, self.dp_group) for lay in layouts])
        items = []
        for (p, group), layout in zip(params_groups, layouts):
            plan = self._plan(p, group)
            work = work_group(layout, self.dp_group, self.tp_group, grids)
            items.append((work, precond_cost(plan.shape, plan.diag)))
        self._owners = dict(zip((p for p, _ in params_groups), assign(items)))
        self._routes = None

    def _ensure_routes(self) -> dict[torch.Tensor, Route | None]:
        """Which of this rank's pieces of each parameter's momentum go to its owner and which
        pieces of the direction come back (one box: the whole tensor): one ``all_gather_object``
        per work group after each binding, from ``step()`` (which every rank calls). Parameters
        without a shared owner (unbound, a work group of one) or whose pieces cannot be routed
        get None: they take the gathering path."""
        if self._routes is not None:
            return self._routes
        by_group: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        for p, owner in self._owners.items():
            if self.route_pieces and owner.shared:
                by_group.setdefault(id(owner.work.group), (owner.work.group, []))[1].append(p)
        routes: dict[torch.Tensor, Route | None] = {}
        for group in ordered_groups(entry[0] for entry in by_group.values()):
            params = by_group[id(group)][1]
            layouts = [self.layout(p) for p in params]
            views = [_route_view(lay.full_shape) for lay in layouts]
            found = plan_routes(
                layouts,
                views,
                [[_whole_box(view)] for view in views],
                [[self._owners[p].rank] for p in params],
                group,
            )
            routes.update(zip(params, found))
        self._routes = routes
        return routes

    def _mine(self, param: torch.Tensor) -> bool:
        owner = self._owners.get(param)
        return owner is None or owner.mine

    def precond_work(self) -> float:
        """Summed :func:`precond_cost` of the parameters this rank owns (all of them when unbound)."""
        total = 0.0
        for group in self.param_groups:
            for p in group["params"]:
                if not self._mine(p):
                    continue
                plan = self._plan(p, group)
                total += precond_cost(plan.shape, plan.diag)
        return total

    def _share(self, entries: Sequence[tuple[torch.Tensor, list[torch.Tensor]]], dtype: torch.dtype | None) -> None:
        """Fill every rank's tensors of ``entries`` (param, tensors) from the param's owner: one
        all_gather per work group (:func:`dist_optim.owners.share_results`; ``dtype`` None: the
        widest of the group's tensors). ``entries`` must list the same params in the same order on
        every rank. Unbound (no owners), nothing moves."""
        share_results([(self._owners[p], tensors) for p, tensors in entries if p in self._owners], dtype)

    # ---- randomness and the update decision ------------------------------------------------------
    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def use_layout_independent_randomness(self) -> str | None:
        """Switch to ``probe_rng="per_parameter"`` (see the class docstring)."""
        if self.probe_rng == "per_parameter":
            return None
        self.probe_rng = "per_parameter"
        return 'probe_rng="per_parameter" (probe vectors seeded by parameter name and step)'

    def _probe_generator(self, p: torch.Tensor, device: torch.device) -> torch.Generator:
        if self.probe_rng == "sequential":
            return self._generator(device)
        key = self.param_names.get(p) or self._position(p)
        digest = hashlib.blake2b(f"{self.seed}|{key}|{int(self.state[p]['step'])}".encode(), digest_size=8).digest()
        gen = torch.Generator(device=device)
        gen.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
        return gen

    def _position(self, p: torch.Tensor) -> str:
        for gi, group in enumerate(self.param_groups):
            for pi, q in enumerate(group["params"]):
                if q is p:
                    return f"{gi}.{pi}"
        raise KeyError("parameter is not in this optimizer")

    def _decide(self) -> tuple[bool, bool]:
        """(update the preconditioners?, balance them first?) for this step; same on every rank."""
        prob = self.param_groups[0]["preconditioner_update_probability"]
        if callable(prob):
            prob = prob(self._prob_step)
        threshold = _threshold(prob)
        self._update_counter += 1
        do_update = self._update_counter >= threshold
        if do_update:
            self._update_counter = 0
        self._prob_step += 1
        balance = self._balance_rng.random() < _BALANCE_PROBABILITY and do_update
        return do_update, balance

    # ---- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._begin_step(closure)
        if not self._gradients_ok():
            return loss
        do_update, balance = self._decide()

        work: list[_Item] = []
        for group in self.param_groups:
            params, grads = self._grads(group)
            b1 = group["b1"]
            for p, g in zip(params, grads):
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["momentum_buffer"] = torch.zeros_like(
                        p, dtype=group["mu_dtype"] or p.dtype, memory_format=torch.preserve_format
                    )
                state["step"] += 1
                m = state["momentum_buffer"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                work.append(_Item(group, p, m, g))
        if not work:
            return loss
        routes = self._ensure_routes() if self.is_bound else {}
        routed: dict[int, tuple[Any, list[_Item]]] = {}
        plain: list[_Item] = []
        for item in work:
            item.route = routes.get(item.p)
            if item.route is None:
                plain.append(item)
            else:
                owner_group = self._owners[item.p].work.group
                routed.setdefault(id(owner_group), (owner_group, []))[1].append(item)
        order = [routed[id(wg)] for wg in ordered_groups(entry[0] for entry in routed.values())]

        self._gather_inputs(plain)
        for wg, items in order:
            self._route_inputs(wg, items)
        for item in work:
            self._direction(item, do_update, balance)
        self._share(
            [(item.p, [item.direction]) for item in plain if item.direction is not None], self.communication_dtype
        )
        for wg, items in order:
            self._route_directions(wg, items)

        for item in work:
            group, p, layout = item.group, item.p, self.layout(item.p)
            assert item.direction is not None
            if item.route is not None:
                local = item.direction.view_as(p)
            else:
                u = item.direction.reshape(layout.full_shape)
                local = u.view_as(p) if layout.is_local else layout.take_local(u)
            if group["weight_decay"] != 0 and layout.ndim >= 2:
                local.add_(p, alpha=group["weight_decay"])
            p.add_(local.to(p.dtype), alpha=-group["lr"])
        return loss

    def _gather_inputs(self, items: Sequence[_Item]) -> None:
        """The fallback: every rank gathers the full momentum (and gradient) of ``items`` (one
        all_gather per ZeRO/TP group; a whole local tensor is used as it is)."""
        if not items:
            return
        tensors = [(self.layout(it.p), t) for it in items for t in it.fit_inputs()]
        comm_dtype = self.communication_dtype or widest_dtype(t for _, t in tensors)
        fulls = iter(gather_full(tensors, dtype=comm_dtype))
        for it in items:
            it.full_m = next(fulls)
            it.full_g = it.full_m if it.group["momentum_into_precond_update"] else next(fulls)

    def _route_inputs(self, wg: Any, items: Sequence[_Item]) -> None:
        """The pieces of the momenta (and gradients) of one work group to their owners, who
        assemble the whole tensors: one all_to_all. A tensor every rank holds whole (replicated)
        is not sent: its owner uses its own copy, the same as every other rank's."""
        moves: list[tuple[Route, torch.Tensor, dict[int, torch.Tensor]]] = []
        for it in items:
            layout = self.layout(it.p)
            assert it.route is not None
            wholes: list[torch.Tensor] = []
            for t in it.fit_inputs():
                if layout.is_local:
                    wholes.append(t)
                    continue
                blocks = {i: t.new_empty(_route_view(layout.full_shape)) for i in it.route.owned}
                moves.append((it.route, t.reshape(-1), blocks))
                wholes.append(blocks.get(0, t))
            if it.route.owned:
                it.full_m = wholes[0]
                it.full_g = wholes[-1]
        # Whether anything is sent is the same on every rank of the work group: its members list
        # the same parameters, each held whole either on all of them or on none (plan_route).
        if moves:
            dtype = self.communication_dtype or widest_dtype(local for _, local, _ in moves)
            to_owners(moves, wg, dtype, moves[0][1].device)

    def _direction(self, item: _Item, do_update: bool, balance: bool) -> None:
        """Draw the probe (every rank with ``probe_rng="sequential"``, so that every generator
        stays in step) and, on the owner, compute the direction; elsewhere a buffer for it."""
        group, p = item.group, item.p
        plan = self._plan(p, group)
        precond_dtype = group["precond_dtype"] or torch.float32
        device = item.m.device
        probe = None
        if do_update and (self.probe_rng == "sequential" or self._mine(p)):
            probe = torch.randn(
                plan.shape, generator=self._probe_generator(p, device), dtype=precond_dtype, device=device
            )
        u = None
        if self._mine(p):
            assert item.full_m is not None and item.full_g is not None
            u = self._owner_direction(p, group, plan, item.full_m, item.full_g, probe, balance)
        item.full_m = item.full_g = None  # the owner's whole input is no longer needed
        if item.route is not None:
            item.owned = u  # from_owners rounds every holder's piece, the owner's included
            return
        if u is None:
            u = torch.empty(plan.shape, dtype=precond_dtype, device=device)
        elif self.communication_dtype is not None and (owner := self._owners.get(p)) is not None and owner.shared:
            # The owner applies what the others receive, so replicas cannot drift apart.
            u = u.to(self.communication_dtype).to(u.dtype)
        item.direction = u

    def _route_directions(self, wg: Any, items: Sequence[_Item]) -> None:
        """The owners' directions of one work group to every rank holding a piece of them, the
        owner included: one all_to_all. :func:`dist_optim.comm.exchange` rounds a rank's pieces to
        itself through the communication dtype too, so every holder applies the same values."""
        moves: list[tuple[Route, dict[int, torch.Tensor], torch.Tensor]] = []
        for it in items:
            layout = self.layout(it.p)
            assert it.route is not None
            precond_dtype = it.group["precond_dtype"] or torch.float32
            blocks = {} if it.owned is None else {0: it.owned.reshape(_route_view(layout.full_shape))}
            local = torch.empty(it.m.numel(), dtype=precond_dtype, device=it.m.device)
            local[layout.valid_numel :].zero_()  # ZeRO padding at the end of a chunk
            moves.append((it.route, blocks, local))
            it.direction = local
        dtype = self.communication_dtype or widest_dtype(local for _, _, local in moves)
        from_owners(moves, wg, dtype, moves[0][2].device)
        for it in items:
            it.owned = None

    def _owner_direction(
        self,
        p: torch.Tensor,
        group: dict[str, Any],
        plan: _Plan,
        full_m: torch.Tensor,
        full_g: torch.Tensor,
        probe: torch.Tensor | None,
        balance: bool,
    ) -> torch.Tensor:
        """On the owner: debias, (balance,) update the factors, precondition, clip."""
        state = self.state[p]
        precond_dtype = group["precond_dtype"] or torch.float32
        if "Q_0" not in state:
            ndim = len(plan.shape)
            scale = group["precond_init_scale"] ** (1 / ndim) if ndim else group["precond_init_scale"]
            for k, (shape, d) in enumerate(zip(plan.factor_shapes(), plan.diag or (True,))):
                if d:
                    factor = torch.full(shape, scale, dtype=precond_dtype, device=full_m.device)
                else:
                    factor = scale * torch.eye(shape[0], dtype=precond_dtype, device=full_m.device)
                state[f"Q_{k}"] = factor
        factors = [state[f"Q_{k}"] for k in range(max(len(plan.shape), 1))]
        b1 = group["b1"]
        debiased = (full_m / (1 - b1 ** int(state["step"]))).to(precond_dtype).reshape(plan.shape)
        if group["momentum_into_precond_update"]:
            fit = debiased
        else:  # a copy: never write into the user's gradient (kron_torch does)
            fit = full_g.to(precond_dtype, copy=True).reshape(plan.shape)
        if balance and len(plan.shape) > 1:
            _balance(factors)
        if probe is not None:
            eps = torch.tensor(torch.finfo(torch.float32).eps, dtype=fit.dtype, device=fit.device)
            fit.add_(eps.sqrt() * fit.abs().mean() * probe)
            tiny = torch.tensor(torch.finfo(precond_dtype).tiny, dtype=precond_dtype, device=fit.device)
            if plan.shape:
                _update_factors(factors, fit, probe, group["precond_lr"], tiny)
            else:
                _update_scalar_factor(factors[0], fit, probe, group["precond_lr"], tiny)
        # kron_torch preconditions the noised debiased momentum (its update adds the probe noise in
        # place); the same here when the fit target is the momentum.
        u = _precondition(factors, debiased)
        if group["clip_update_rms"]:
            _clip_rms(u)
        return u

    # ---- state -------------------------------------------------------------------------------------
    def full_state(self) -> list[dict[str, Any]]:
        """Every parameter's state in full form on every rank: ``step``, ``momentum_buffer``
        (parameter-shaped) and the factors ``Q_0, Q_1, ...`` (shared from their owners).
        Collective when bound."""
        out = super().full_state()
        for p, entry in zip(self._all_params(), out):
            momentum = entry.get("momentum_buffer")
            if momentum is not None and momentum.data_ptr() == self.state[p]["momentum_buffer"].data_ptr():
                # comm.gather_full hands a whole local tensor back as is: copy it, so that the
                # returned state does not change with the next step
                entry["momentum_buffer"] = momentum.clone()
        entries: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        where: list[int] = []
        params_groups = [(p, g) for g in self.param_groups for p in g["params"]]
        for i, (p, group) in enumerate(params_groups):
            state = self.state.get(p)
            if not state:
                continue
            plan = self._plan(p, group)
            dtype = group["precond_dtype"] or torch.float32
            if self._mine(p):
                tensors = [state[f"Q_{k}"].clone() for k in range(len(plan.factor_shapes()))]
            else:
                tensors = [torch.empty(s, dtype=dtype, device=p.device) for s in plan.factor_shapes()]
            entries.append((p, tensors))
            where.append(i)
        self._share(entries, None)
        for i, (_, tensors) in zip(where, entries):
            for k, t in enumerate(tensors):
                out[i][f"Q_{k}"] = t
        return out

    def keeps_saved_dtype(self, key: str, value: torch.Tensor) -> bool:
        """The factors (``precond_dtype``) and the momentum (``mu_dtype``) keep their saved dtype on
        load; torch's loader would cast them to the parameter's."""
        return key.startswith("Q_") or key == "momentum_buffer"

    def _localize_state(self, param: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """For ``load_full_state``: only the owner keeps a parameter's factors."""
        if self._mine(param):
            return state
        return {k: v for k, v in state.items() if not k.startswith("Q_")}

    def extra_state(self) -> dict[str, Any]:
        """The skipped-step counter, the step counters of the update decision and the generator
        states (the same on every rank): with :meth:`full_state` they resume the same trajectory
        under any layout."""
        return {
            **super().extra_state(),
            "prob_step": self._prob_step,
            "update_counter": self._update_counter,
            "balance_rng": self._balance_rng.getstate(),
            "generators": {str(d): g.get_state() for d, g in self._generators.items()},
        }

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        super().load_extra_state(extra)
        self._prob_step = int(extra["prob_step"])
        self._update_counter = int(extra["update_counter"])
        self._balance_rng.setstate(extra["balance_rng"])
        for name, st in extra["generators"].items():
            self._generator(torch.device(name)).set_state(st)


# ---- helpers and validation ----------------------------------------------------------------------
@dataclass(eq=False)
class _Item:
    """One parameter's step: its inputs and, as they come, the route, the owner's whole inputs,
    the owner's whole direction and this rank's direction (whole, or its local piece when
    routed)."""

    group: dict[str, Any]
    p: torch.Tensor
    m: torch.Tensor
    g: torch.Tensor
    route: Route | None = None
    full_m: torch.Tensor | None = None
    full_g: torch.Tensor | None = None
    owned: torch.Tensor | None = None
    direction: torch.Tensor | None = None

    def fit_inputs(self) -> list[torch.Tensor]:
        """The tensors the owner needs whole: the momentum, and the gradient where the
        preconditioner is fitted to it."""
        return [self.m] if self.group["momentum_into_precond_update"] else [self.m, self.g]


def _route_view(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a parameter is routed in: its full shape (a scalar as one element)."""
    return tuple(shape) or (1,)


def _whole_box(shape: tuple[int, ...]) -> Box:
    """The box of a whole tensor of ``shape``."""
    return tuple((0, n) for n in shape)


def _threshold(prob: Any) -> float:
    """``1 / prob`` as kron_torch compares it with its int counter: in fp32 (a float tensor
    keeps its dtype; a Python float is divided in double, then compared in fp32)."""
    if isinstance(prob, torch.Tensor):
        value = prob.detach().to("cpu")
        if not value.is_floating_point():
            value = value.float()
        p = float(value)
        recip = float(1 / value)
    else:
        p = float(prob)
        recip = float(torch.tensor(1.0 / p, dtype=torch.float32)) if p > 0 else math.inf
    if not 0 < p <= 1:
        raise ValueError(f"preconditioner_update_probability must be in (0, 1], got {p}")
    return recip


#: The options of a param group (kron_torch's too, but for its two booleans).
_GROUP_OPTIONS = (
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
)


def _check_probability(prob: Any) -> None:
    """A probability in (0, 1] or a callable of the step (checked when it is called)."""
    if callable(prob):
        return
    if not isinstance(prob, (int, float)) or isinstance(prob, bool) or not 0 < prob <= 1:
        raise ValueError(f"preconditioner_update_probability must be in (0, 1] or a callable of the step, got {prob!r}")


# ---- conversion from kron_torch ------------------------------------------------------------------
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


register(
    Conversion(
        "kron_torch.kron.Kron",
        DistributedKron,
        _kron_torch_kron,
        # kron_torch's options: the group options plus the two booleans
        frozenset(_GROUP_OPTIONS) | {"momentum_into_precond_update", "merge_dims"},
    )
)

register_plan(PlanEntry("kron", DistributedKron))

# Saved states name the optimizer by its class path (base.class_path: state_dict(), checkpoints, the
# registry) and param groups pickle the default schedule by its module: keep the names of the
# single-module version, dist_optim.kron.<Name>, so states saved before and after the split load
# under either (the package re-exports both).
for _cls in (DistributedKron, ProbabilitySchedule):
    _cls.__module__ = "dist_optim.kron"
