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
triangular one. Factors start at ``precond_init_scale ** (1 / ndim)`` times identity
(``precond_init_scale=None``: ``mean(|G|^4)^(-1/8)`` of the parameter's first gradient, on its
owner, which holds the whole gradient; a gradient of zeros or non-finite values falls back to 1). With
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
  factors are state keys ``Q_0, Q_1, ...`` (kron_torch: a list ``Q`` plus einsum strings; with
  ``use_symmetric_packing`` the triangular ones as packed upper triangles, :mod:`.state`);
  ``step`` is a CPU float tensor (torch's convention).
* kron_torch mutates ``p.grad`` in place (adds the probe noise) with
  ``momentum_into_precond_update=False``; we do not touch gradients. kron_torch prints buffer
  sizes on the first step; we do not.
* The contractions are written as matrix products along one dim at a time instead of einsum,
  and they skip what the structure makes known (:mod:`dist_optim.kernels.structured`: the zero half of
  the upper-triangular factors, the mirrored half of the Gram matrices): the same math, fp32
  rounding differs (~1e-7 relative), about a third of the multiply-adds of a large factor.
* ``clip_update_rms`` (default True) can switch the RMS clipping off, as in kron_torch's
  DistributedKron.

Distribution. Preconditioners are functions of the *full* tensor, so each parameter has one
owner rank among the ranks that hold pieces of it: its work group (:mod:`dist_optim.sharding.owners`: the
TP x data-parallel grid of its ZeRO group, or of the data-parallel group; assigned once at bind
time by :func:`dist_optim.sharding.owners.plan_tasks` with the cost model :func:`precond_cost`). The owner keeps
the factors. Per step:

1. every rank updates its local piece of the momentum (elementwise, exact);
2. every rank sends its pieces of each momentum (and of the gradient with
   ``momentum_into_precond_update=False``) straight to the parameter's owner, which assembles the
   whole tensor (:func:`dist_optim.sharding.owners.to_owners`: one all_to_all per work group for all its
   parameters; a tensor every rank holds whole, replicated, is not sent: its owner has it);
3. the owner debiases, updates its factors, preconditions and clips, on the whole tensor exactly
   as a single device does;
4. the owner sends every rank that holds a piece of the parameter that piece of the direction
   (:func:`dist_optim.sharding.owners.from_owners`: one all_to_all per work group);
5. each rank applies weight decay and the step to its own elements.

Which piece goes where is planned once per binding, at the first step (one all_gather_object per
work group, :func:`dist_optim.sharding.owners.route_tasks`). So a step issues the NaN/Inf check's flag
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
``dist_optim.sharding.runtime.OwnerRuntime.route_pieces = False``) every rank gathers the full momentum
(:func:`dist_optim.comm.gather_full`, one all_gather per ZeRO/TP group) and receives the owner's full direction
(:func:`dist_optim.sharding.owners.share_results`, one all_gather per work group): the same result, bit
for bit in fp32. :meth:`DistributedKron.full_state` returns every factor in full on every rank.

Memory: the owner holds the whole momentum of each parameter it owns (received, or its own when
every rank holds the tensor whole) while it works on it. A tensor of at least 64 MiB with a
diagonal factor is worked on in 32 MiB blocks along that factor's dim (:mod:`.blocks`: the
direction written into the received momentum, the probe drawn block by block), smaller ones whole
with their temporaries dropped as soon as they are used; with ``probe_rng="sequential"`` every
rank draws (and non-owners discard, one chunk at a time) the probe of every parameter on update
steps, so that every generator stays in step. The step's buckets of ``bucket_bytes`` bound what
moves at once (two buckets in flight). Under MoE without ZeRO, expert parameters would be owned
across the plain data-parallel group, which spans different experts (pass
``zero_group_of``/use ZeRO).

The package, split as :mod:`dist_optim.shampoo` is (math on local tensors apart from who computes
what and how tensors move):

* :mod:`.options`: the param-group defaults and their checks (``validate_group``), and the checks
  of the optimizer-wide arguments;
* :mod:`.schedule`: the update-probability schedule and the ``1 / p`` threshold;
* :mod:`.randomness`: the probe generators, the balancing draw and the update-decision counters
  (:class:`~.randomness.KronRandomness`, its part of ``extra_state``);
* :mod:`.structure`: merged shapes, diagonal or triangular factors, the cost model;
* :mod:`.state`: what ``optimizer.state`` holds per parameter and its keys, and the stored forms
  of the factors (``use_symmetric_packing``: packed triangles; ``preconditioner_bits=8``:
  block-wise codes, :mod:`dist_optim.states.lowbit`, as Wang et al. 2024, arXiv:2405.18144, keep
  Shampoo's preconditioners; a deviation from kron_torch, which keeps them in ``precond_dtype``);
* :mod:`.momentum`: the momentum's update on the holders, in ``mu_dtype`` or 8-bit
  (``optim_bits=8``: bitsandbytes' block-wise codes, Dettmers et al. 2022, arXiv:2110.02861);
* :mod:`.preconditioner`: factor initialisation, the fit with probes, balancing, preconditioning
  and clipping, on whole local tensors, no communication;
* :mod:`.blocks`: the block plan of a large tensor's owner work and the probe's chunks;
* :mod:`.owners`: the owner of each parameter, as a task of the owner runtime
  (:mod:`dist_optim.sharding.runtime`, which moves momenta and directions);
* :mod:`.optimizer`: :class:`DistributedKron`, the coordinator;
* :mod:`.conversions`: ``kron_torch.kron.Kron`` -> :class:`DistributedKron` and the planner entry,
  registered when the package is imported.
* :mod:`.variant`: ``variant="heavyball"``, heavyball's PSGD Kron (its momentum, update rule, noise,
  balancing, lower-bounded factor steps, trust-region clip), and :mod:`.heavyball`:
  ``heavyball.PSGDKron`` -> :class:`DistributedKron` with it.
"""

# Registers the kron_torch conversion and the planner entry, so that `import dist_optim` does.
from . import conversions, heavyball  # noqa: F401
from .optimizer import DistributedKron
from .schedule import ProbabilitySchedule, precond_update_prob_schedule
from .structure import precond_cost

__all__ = ["DistributedKron", "ProbabilitySchedule", "precond_update_prob_schedule", "precond_cost"]
