"""Shampoo, and Shampoo with eigenvalue correction (SOAP), exact under tensor parallelism and ZeRO.

Papers: Gupta, Koren & Singer 2018, "Shampoo: Preconditioned Stochastic Tensor Optimization"
(arXiv:1802.09568); Anil et al. 2020, "Scalable Second Order Optimization for Deep Learning"
(arXiv:2002.09018: blocking, grafting, amortised roots, failure handling); Shi et al. 2023, "A
Distributed Data-Parallel PyTorch Implementation of the Distributed Shampoo Optimizer for Training
Neural Networks At-Scale" (arXiv:2309.06497: the options and the work split this class follows);
Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam" (arXiv:2409.11321);
Lin et al. 2025 (arXiv:2509.03378: KL-Shampoo and KL-SOAP).

Per parameter, with ``t`` its 1-based step (steps without a gradient do not count):

1. ``G = grad`` (``+ weight_decay * W`` unless the decay is decoupled). With ``merge_small_dims``
   consecutive dims are merged while their product stays <= ``max_preconditioner_dim``; the (full)
   tensor is then cut into blocks of at most ``max_preconditioner_dim`` along every dim.
2. Per block and dim ``k``: ``L_k <- b2 L_k + (1 - b2) G_(k) G_(k)^T`` (``b2 == 1``: plain sum),
   every ``statistics_compute_steps`` steps. A 1-D block has one full-matrix factor.
3. ``M <- b1 M + (1 - b1) G``, ``Mhat = M / (1 - b1^t)`` (with bias correction; ``b1 == 0``:
   ``Mhat = G``). Grafting state per block and grafting direction ``D``: SGD ``Mhat``; AdaGrad
   ``V += G^2``, ``Mhat / (sqrt(V) + eps_g)``; RMSprop ``V <- b V + (1 - b) G^2``,
   ``Mhat / (sqrt(V) + eps_g)``; Adam as RMSprop with ``V / (1 - b^t)``; no grafting: ``Mhat``.
4. Roots at ``t == start`` and whenever ``t % precondition_frequency == 0 and t > start``:
   ``A = L / (1 - b2^n)`` (bias correction, ``n`` factor updates so far),
   ``R = (A + epsilon I)^(-exponent_multiplier / r)``, ``r = 2 * order of the block`` unless
   ``exponent_override``; see :func:`dist_optim.kernels.matrix_functions.matrix_inverse_root`. A root that is not
   finite or whose iteration error exceeds ``inverse_failure_threshold`` is discarded: the previous
   root is kept (identity before the first) and ``block<i>.failures`` counts it.
   ``root_inverse="warm"`` (Meta's ``EighEigendecompositionConfig(tolerance)`` and
   ``QREigendecompositionConfig`` in one, with a recomputation where Meta's QR has none): the block
   keeps ``Q_k``, the eigenvectors of its last refresh (made by ``eigh`` at the first), and
   refreshes from them by :func:`dist_optim.kernels.matrix_functions.warm_eigh` on ``A + epsilon I``:
   ``B = Q^T (A + epsilon I) Q``; if ``||B - diag(B)||_F <= refresh_tolerance ||B||_F`` the
   eigenvectors are kept and ``R = Q diag(B)^(-alpha) Q^T`` (a product and two symmetric ones
   instead of an ``eigh``); else up to ``refresh_iterations`` QR-algorithm steps on ``B`` (columns first sorted
   by decreasing ``diag(B)``) until the criterion holds; else ``eigh`` as ``root_inverse="eigh"``
   (the same root bit for bit). Accuracy: the root taken is exact for a matrix within
   ``refresh_tolerance`` of ``A + epsilon I`` in relative Frobenius norm; docs/benchmarks.md gives
   the roots' measured error against float64 ``eigh`` and the refresh's cost. The criteria of a
   batch of blocks are read by the host at once (:mod:`.preconditioner.warm`), not once per factor.
5. Direction: before ``start`` ``P = D``; then ``P = Mhat x_0 R_0 x_1 R_1 ...`` scaled per block to
   ``||D||``: ``P <- P ||D|| / (||P|| + 1e-16)`` (no rescaling without grafting).
6. ``P <- P + weight_decay W`` (decoupled); momentum ``B <- momentum B + P`` and ``P = B`` (or
   ``P + momentum B`` with Nesterov); ``W <- W - lr P``.

SOAP (``eigenvalue_correction=True``): Adam in the eigenbasis ``Q_k`` of the factors, ``Q_k = I``
until the first refresh. At the steps of (4), with ``A = L / (1 - b2^n)``, the basis is refreshed:

* ``eigenbasis="eigh"``: the eigenvectors of ``A``, decreasing eigenvalues; ``"eigh-ascending"``
  in increasing order, as Meta's ``EighEigendecompositionConfig`` keeps them (below).
* ``eigenbasis="qr"``: Meta's ``DefaultSOAPConfig`` (``QREigendecompositionConfig(max_iterations=1)``):
  one QR-algorithm step from the current basis (the identity at the first refresh),
  ``B = Q^T (A + epsilon I) Q``, ``Q' R = qr(B)``, ``Q <- Q Q'``, columns sorted by ``diag(R Q')``
  increasing (:func:`dist_optim.kernels.matrix_functions.qr_algorithm_step`).
* ``eigenbasis="qr-eigh-start"``: Vyas et al.'s recipe: the eigenvectors at the first refresh, then
  one power step ``Q' R = qr(A Q)`` from the current basis whose columns are first sorted by
  decreasing ``diag(Q^T A Q)``, ``S`` below permuted with them
  (:func:`dist_optim.kernels.matrix_functions.qr_power_step`).
* ``eigenbasis="qr-lifted"``: heavyball's: the eigenvectors at the first refresh (LAPACK's signs),
  then one power step on ``A + c I``, ``c = max(epsilon, 64 d eps) max_j |diag(Q^T A Q)_j|`` (a
  rank-deficient factor's null space kept from rounding noise), the columns sorted by that estimate
  for the QR and put back in place: ``S`` is not permuted
  (:func:`dist_optim.kernels.matrix_functions.lifted_qr_step`).
* ``eigenbasis="warm"``: the eigenvectors at the first refresh, then
  :func:`dist_optim.kernels.matrix_functions.warm_eigh` from the current basis as for ``root_inverse="warm"``
  (on ``A``, without ``epsilon``): kept within ``refresh_tolerance``, else QR-algorithm steps
  (``S`` permuted with the columns they sort), else the eigenvectors as ``"eigh"`` makes them.

Otherwise ``S`` is kept as it is across a refresh, not rotated into the new basis (as in Meta's
and Vyas et al.'s code). Then ``Gr = G x_k Q_k^T`` (the refreshed basis), ``S <- b2 S + (1 - b2) Gr^2``,
``P = (Mhat x_k Q_k^T) / (sqrt(S / (1 - b2^t)) + epsilon)`` rotated back with ``x_k Q_k``;
grafting as in (5) if configured; then (6). Without grafting the first moment is kept in the
eigenbasis, ``Mr = M x_k Q_k^T`` (state ``exp_avg_eigen``; ``Mr <- b1 Mr + (1 - b1) Gr``, rotated
by ``x_k Q_k'^T Q_k`` when a refresh changes the basis), as in Vyas et al.'s later code and
heavyball: the same ``Mhat x_k Q_k^T`` in exact arithmetic with two rotations a step instead of
three. With grafting it stays in the parameter's basis (``exp_avg``), where ``D`` needs it.

``soap_step="heavyball"`` (heavyball's SOAP, Vyas et al.'s order; :mod:`.preconditioner.heavyball`):
a parameter's first step seeds its factors with ``G_(k) G_(k)^T`` and its bases (no update); later
steps take the direction in the bases of the previous step, then the statistics, then the refresh;
moments and factors are bias-corrected averages counted in the optimizer's steps, ``epsilon`` floors
``sqrt(S)``, and the refreshes follow heavyball's running sum of ``1 / precondition_frequency``.
``shampoo_beta`` is the factors' own EMA coefficient (``betas[1]`` by default).

``kl_statistics=True``: KL-Shampoo and, with SOAP, KL-SOAP (Lin et al. 2025, "Understanding and
Improving Shampoo and SOAP via Kullback-Leibler Minimization", arXiv:2509.03378), whose statistics
in (2) whiten the gradient along the other dims by their current estimate: Shampoo's roots
(``G x_{j != k} R_j``), or SOAP's inverse factors in its basis, ``L_k <- b2 L_k + (1 - b2) G_(k)
(x_{j != k} Q_j diag(lam_j)^-1 Q_j^T) G_(k)^T / prod_{j != k} d_j`` with ``lam_j = max(diag(Q_j^T
A_j Q_j), epsilon)`` of the factors before the step's statistics (``lam_j = 1`` at the first); see
:mod:`.preconditioner.factors`. No state of their own; every other option as for Shampoo and SOAP,
except quantised roots or bases (``preconditioner_bits``), which the statistics cannot read whole.

Deviations, all stated:

* ``start_preconditioning_step`` 0 or 1 both mean "from the first step" (Meta's 0/1 rules); any
  other value below ``precondition_frequency`` is refused.
* Before the first root, the preconditioner is the identity (the default path does not use it
  before ``start``; it matters only when the first root fails).
* SOAP uses its direction from step 1 (identity basis until the first refresh), also with
  grafting; Meta's uses the grafting direction alone before ``start`` when grafting is
  configured (without grafting, as with ``DefaultSOAPConfig`` alone, the two agree).
* ``t`` counts a parameter's own steps (those with a gradient); Meta's counts the steps of the
  parameter group, so after a step without a gradient Meta's bias corrections and refresh steps
  of that parameter differ from ours (Shampoo and SOAP alike).
* A basis refresh that is not finite keeps the previous basis and is counted in
  ``block<i>.failures`` (Meta's raises).
* ``eigenbasis="eigh"`` orders its columns by decreasing eigenvalue (canonical signs, Vyas et
  al.'s order), Meta's ``EighEigendecompositionConfig`` by increasing eigenvalue. ``S`` is kept per
  column across a refresh, so what it accumulated in the identity basis before the first refresh
  is attached to other columns than in Meta's; ``"eigh-ascending"`` keeps Meta's order, and the
  conversion maps Meta's config to it (signs do not matter: ``S`` is a square and ``Mhat`` is
  rotated there and back).
* The iterative root methods use the same absolute ``epsilon`` as ``eigh`` (Meta's higher-order
  method scales it by an estimate of the largest eigenvalue); they need ``exponent_multiplier=1``.
* ``skip_preconditioning_dim_size_gt`` (Anil et al.) applies per parameter: a parameter with a
  (merged, full) dim above it uses the grafting direction only (SOAP: Adam in the identity basis).
* A gradient with NaN/Inf raises ``FloatingPointError`` naming the parameter, or with
  ``nonfinite="skip"`` skips the whole step (nothing changes, ``skipped_steps`` counts it), the
  policy every dist_optim optimizer shares (:class:`~dist_optim.base.DistOptimizer`). Detecting it
  is one host read per step (and, bound, one all-reduce of a flag over the job, before any
  gradient moves); root refreshes also read scalars (amortised).

Distribution: blocks are defined on the *full* tensor, so TP and ZeRO do not change the math.
Every block is owned by one rank of its work group by a cost model ``sum_k d_k^3``, through the
owner interface every owner-computing optimizer shares (:mod:`dist_optim.sharding.owners`): the work group
is the data-parallel group (the ZeRO group of a ZeRO-sharded parameter), or under TP the TP x DP
grid that group spans with the TP group (made when the optimizer is bound, collectively over the
job, :class:`dist_optim.sharding.owners.WorkGroups`). Owners
update their blocks' state and compute the block directions; each rank applies the part of the
update that it holds. How gradients reach the owners and directions the holders:

* A parameter held in pieces (TP slices, ZeRO chunks): each rank sends the pieces it holds of
  every block straight to that block's owner, and each owner sends the pieces of its directions to
  every rank that holds them (:func:`dist_optim.sharding.owners.route_tasks` says which, from every rank's pieces,
  asked once per work group in the first step; :func:`dist_optim.sharding.owners.to_owners` and
  :func:`dist_optim.sharding.owners.from_owners`: one all_to_all per work group and direction for all parameters,
  in ``communication_dtype``, a rank's pieces to itself included so that every copy of a value
  is rounded alike). A rank receives its blocks' gradients and its
  pieces' directions: about ``2/size`` of the parameters' bytes instead of ``2x`` (the ratio to
  gathering everything, per layout, is bounded in ``tests/unit/test_shampoo.py``
  ``test_pieces_go_straight_to_block_owners``), and nobody holds a full gradient.
* A parameter held whole on every rank (DDP): owners use their local gradient, nothing is sent to
  them; the directions come back the same way, every rank receiving every block's direction (in
  ``communication_dtype``; owners round their own results the same way so replicas agree).
* Where the pieces are not boxes of the blocking's view (a TP-split dim merged with others by
  ``merge_small_dims``), full gradients are gathered (one all_gather per TP/ZeRO group) and the
  directions shared as under DDP.

Block state (factors, roots, bases, moments, grafting state) lives only on its owner: memory of
the preconditioners is divided across the group (:meth:`DistributedShampoo.state_bytes`);
:meth:`DistributedShampoo.full_state` gathers it back.

Compact states (:mod:`.state`): ``use_symmetric_packing`` keeps the symmetric matrices
as packed triangles (lossless); ``optim_bits=8`` the moments, grafting state and momentum as
bitsandbytes' 8-bit codes (a state saved with the other ``optim_bits`` carried over at the next
step); ``preconditioner_bits`` 8 or 4 keeps, instead of each root ``R_k``, the
eigenvectors of its damped factor block-wise quantised with the root's eigenvalues in fp32 (SOAP:
its bases quantised), dequantised and rectified by one Björck step at each use (Wang et al. 2024,
"4-bit Shampoo"; the algorithm and its deviations: :mod:`.preconditioner.quantized`, the format:
:mod:`dist_optim.states.lowbit`). The factors stay in ``preconditioner_dtype``. A block's owner quantises
its whole matrices, so the distributed result stays the single-device one bit for bit.

Cost (see docs/benchmarks.md): factors larger than ``structured.MIN_SIZE`` (256) are updated
in one triangle only (:func:`blocking.kept_triangle`), ~0.56 of a full product's multiply-adds, and
mirrored when a root is computed and by ``state_dict()`` / ``full_state()``, so
``optimizer.state`` read directly between refreshes holds a stale triangle there. An owner's
blocks of a step go in batches (:mod:`.work`): Adam grafting's moments and directions come from
one call of torch's fused Adam kernel per batch (not for SOAP, see
:func:`preconditioner.grafting.update_moments`), the small factors' statistics, the grafting's
norms and scaling and the updates from one ``torch._foreach_*`` call per operation, and only the
matrix products go block by block; on a GPU that bounds the host's launches per block, which
Meta's step had far fewer of (``bench/shampoo_vs_meta.py --host-blocks``, docs/benchmarks.md).

The package, after Meta's split of preconditioners (math) and distributor (who computes what), with
one :class:`~dist_optim.layout.ParamLayout` covering DDP, TP and ZeRO instead of a distributor per
parallelism:

* :mod:`.options`: the grafting configurations and the checks of a param group;
* :mod:`.blocking`: merged dims, blocks, kept triangles, products along every dim;
* :mod:`.state`: a block's typed state (:class:`~.state.BlockState`) and its flat form in
  ``optimizer.state`` (``"block<i>.<name>"``, what checkpoints hold), reused scratch memory;
* :mod:`.preconditioner`: a batch of blocks' math on local tensors, no communication (grafting,
  factors, root-inverse Shampoo, SOAP);
* :mod:`.work`: an owner's blocks of a step cut into batches, their directions applied or handed back;
* :mod:`.owners`: the owners of blocks, as tasks of the owner runtime (:mod:`dist_optim.sharding.runtime`,
  which moves gradients and directions);
* :mod:`.update`: momentum, decay and the parameter update;
* :mod:`.optimizer`: :class:`DistributedShampoo`, the coordinator.
"""

from ..registry import CatalogueEntry, Demo, register_entry
from . import conversions  # noqa: F401  (registers the conversion from Meta's DistributedShampoo)
from .blocking import Block, apply_each_dim, kept_triangle, merge_small_dims, plan_blocks
from .optimizer import DistributedShampoo
from .options import (
    AdaGradGraftingConfig,
    AdamGraftingConfig,
    GraftingConfig,
    RMSpropGraftingConfig,
    SGDGraftingConfig,
)

__all__ = [
    "DistributedShampoo",
    "SGDGraftingConfig",
    "AdaGradGraftingConfig",
    "RMSpropGraftingConfig",
    "AdamGraftingConfig",
    "GraftingConfig",
    "Block",
    "merge_small_dims",
    "plan_blocks",
    "kept_triangle",
    "apply_each_dim",
]

_REFRESH = {"precondition_frequency": 2, "start_preconditioning_step": 2}
_TRANSIENT = "bucket_bytes (full gradients moved per bucket), communication_dtype"
register_entry(
    CatalogueEntry(
        "shampoo",
        DistributedShampoo,
        # Adam grafting as Meta's README configures it: without grafting at epsilon 1e-12 Shampoo's
        # first roots of near-singular factors blow the update up (NaN within a few dozen steps).
        recommended=dict(
            precondition_frequency=10,
            start_preconditioning_step=10,
            grafting_config=AdamGraftingConfig(beta2=0.999, epsilon=1e-8),
        ),
        refresh=_REFRESH,
        transient=_TRANSIENT,
        demo=Demo("Shampoo (Adam grafting, pf=10)", 4.6e-3),
    )
)
register_entry(
    CatalogueEntry(
        "soap",
        DistributedShampoo,
        # SOAP as Vyas et al. run it: eigenvectors at the first refresh, then one power step.
        recommended=dict(
            eigenvalue_correction=True,
            eigenbasis="qr-eigh-start",
            betas=(0.95, 0.95),
            epsilon=1e-8,
            precondition_frequency=10,
            start_preconditioning_step=10,
        ),
        plan_options=dict(eigenvalue_correction=True, eigenbasis="qr-eigh-start"),
        refresh=_REFRESH,
        transient=_TRANSIENT,
        demo=Demo("SOAP (pf=10)", 3e-2),
        planned=False,
    )
)
