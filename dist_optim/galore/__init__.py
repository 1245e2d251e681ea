"""GaLore: gradient low-rank projection (Zhao et al., 2024, "GaLore: Memory-Efficient LLM Training
by Gradient Low-Rank Projection", arXiv:2403.03507), with AdamW in the low-rank space and optional
8-bit block-wise quantised moments (Dettmers et al., 2022, "8-bit Optimizers via Block-wise
Quantization", arXiv:2110.02861).

For a matrix parameter ``W`` (``M x N``) in a GaLore group (a group with a ``rank`` key, as in
``galore_torch``), with gradient ``G``:

* every ``update_proj_gap`` steps of that parameter (and at its first step) a projector is taken
  from the SVD ``G = U S V^T`` of the *full* gradient: ``P = U[:, :r]`` ("left", ``M x r``) or
  ``Q = V^T[:r]`` ("right", ``r x N``) or both ("full"). ``proj_type`` chooses as galore_torch's
  ``GaLoreProjector``: ``std`` projects the smaller side (right when ``M >= N``),
  ``reverse_std`` the larger, ``left``/``right``/``full`` as named;
* the low-rank gradient ``R = P^T G`` / ``G Q^T`` / ``P^T G Q^T`` drives AdamW moments of the
  low-rank shape; the normalised step ``m / (sqrt(v) + eps)`` is projected back
  (``P N`` / ``N Q`` / ``P N Q``), multiplied by ``scale`` and applied with the bias-corrected
  step size; decoupled weight decay ``W <- W - lr * wd * W`` follows the update, as galore_torch
  does.

Parameters in groups without ``rank`` get plain AdamW with the same update rule.

``adam_style`` picks which reference the AdamW arithmetic follows:

* ``"hf"`` (default): ``galore_torch.GaLoreAdamW`` (transformers' AdamW): ``eps`` is added to
  ``sqrt(v)`` *before* bias correction, ``step = lr * sqrt(1 - b2^t) / (1 - b1^t)``, and
  ``correct_bias=False`` drops the correction; weight decay after the update.
* ``"bnb"``: ``galore_torch.GaLoreAdamW8bit`` / ColossalAI's ``GaLoreAdamW8bit`` (bitsandbytes'
  Adam kernel): ``denom = sqrt(v) / sqrt(1 - b2^t) + eps``, ``step = lr / (1 - b1^t)``; GaLore
  params are decayed after their update (galore_torch), plain params before it (bitsandbytes).

8-bit states (``optim_bits=8``): the moments (low-rank ``low_rank_exp_avg[_sq]`` of GaLore params,
``exp_avg[_sq]`` of plain params, as bitsandbytes' GaLoreAdamW8bit) are stored as uint8 codes plus
one fp32 absmax per block of 256 values, quantised with bitsandbytes'
``functional.quantize_blockwise`` / ``dequantize_blockwise`` and its signed / unsigned dynamic
maps (the format of bitsandbytes' own 8-bit blockwise Adam; :mod:`dist_optim.states.bnb`). Each
step dequantises, updates in fp32, takes the step from the fp32 values and re-quantises, as
bitsandbytes' kernel does. Like bitsandbytes, moments with fewer than ``min_8bit_size`` elements
stay fp32. ``is_paged`` allocates moments of >= 1e5 elements in bitsandbytes' paged (CUDA
unified) memory; on CPU it warns and uses ordinary tensors.

Distributed (TP slices, ZeRO chunks, both): every quantity the algorithm reads is of the full
matrix, and what a rank keeps of a matrix's state is a 1/n partition of it, as ZeRO partitions
full moments (:mod:`dist_optim.sharding.partition`: the flattened tensor cut into n contiguous parts, rank
``(r_0, r_1)`` of its groups keeping part ``r_0 s_1 + r_1``):

* the projectors over the matrix's *work group* (the TP x ZeRO/data-parallel grid of the ranks that
  hold it, :mod:`dist_optim.sharding.owners`): every rank of it needs the whole projectors to project its
  pieces (under TP, ``std`` projects the un-split side), so they are kept 1/n and gathered per
  bucket for the step;
* the low-rank moments (fp32, or 8-bit codes and their ``*_absmax``) over the ranks that hold
  pieces of the matrix (its ``sum_groups``: ZeRO group, then TP group), where the partial low-rank
  gradients are summed. 8-bit parts begin on a 256-value block boundary (``align``), so each rank
  quantises whole blocks of the full tensor with bitsandbytes' own kernel and codes and absmax are
  those of one device. A matrix that TP replicates (not split) has its moments partitioned over
  its TP peers too: they hold the same sum, and each keeps its part of it (no collective but the
  step's all-gather, which its TP-split neighbours' share). Data-parallel replicas without ZeRO
  (DDP, ZeRO-0) keep the moments whole, as ZeRO-0 keeps every state; their projectors are still
  partitioned over the work group.

:meth:`DistributedGaLore.full_state` assembles the full tensors (checkpoints keep the
layout-independent full form) and ``load_full_state`` cuts this rank's parts, so a checkpoint
loads under any other layout. ``optimizer.state_partitions(p)`` names each entry's groups.

* Refresh steps: each SVD has one owner rank in the matrix's work group (owners balanced by the
  SVDs' cost, planned once with the routes of the gradient's pieces). Bucket by bucket
  (``bucket_bytes`` of full gradients, :mod:`dist_optim.sharding.budget`), every rank sends its pieces of
  the bucket's gradients straight to their owners (``owners.to_owners``: one all-to-all per work
  group), each owner computes its SVDs on the whole matrices it assembled, and sends each rank of
  the work group its partition of the projectors (``owners.scatter_results``: one all-to-all per
  work group; with it one value saying whether the SVD succeeded, so that a failed SVD keeps the
  previous partitions everywhere). The full gradients are dropped before the next bucket. No rank
  holds a full gradient it does not own, and no rank but the owner a whole new projector.
  Where the pieces do not tile a matrix (no route), that matrix is gathered whole as a fallback.
* Every step, bucket by bucket (``bucket_bytes`` of low-rank gradients plus whole projectors):
  the bucket's whole projectors are all-gathered from their partitions (one all-gather per work
  group), then dropped after the bucket. The projection is a sum over the projected dim: each rank
  multiplies the pieces of ``G`` it holds (a TP slice, or the <= 3 rectangles a flat ZeRO chunk
  covers) with the matching rows/cols of the projector into a zero low-rank tensor of the full
  shape, and the partial sums are reduce-scattered over the holders in rank order (one all-to-all
  per group and stage: over the ZeRO group, then the chunk over the TP group), each rank receiving
  its partition of the summed low-rank gradient: the same additions in the same order as a
  whole-tensor sum over the ZeRO group then the TP group, and the same bits for every budget.
  Each rank updates its partition of the moments, computes its partition of the normalised step
  ``m / denom``, and the step is all-gathered back (one all-gather per group and stage, over the TP
  group then the ZeRO group: the reduce-scatter's bytes); the back-projection gives each rank
  exactly its own elements. No full gradient is gathered
  between refreshes.

  What partitioning costs in traffic: the projectors' all-gather, ``(n-1)/n`` of the whole
  projectors' bytes per rank and step (32-bit mode: the gradient's dtype; 8-bit: fp16). Llama-2-70B
  at rank 128: ``128 x 8192`` or ``8192 x 128`` for q, o, gate, up, down and ``1024 x 128`` for k,
  v, 5.24 M values per layer, 80 layers, 1.68 GB in fp32, so 1.65 GB per step at 64 ranks; small
  next to the gradient traffic of ZeRO itself (the bf16 gradients' reduce-scatter,
  ``70e9 / 8 x 2 B x 7/8``, about 15 GB per rank at tp=8 x dp=8).
  What it saves: the TP stage of the low-rank sum now runs on the ZeRO chunk instead of
  the whole low-rank tensor, so a steady step sends 11.3 GB instead of 17.0 at 70B tp=8 x dp=8 x
  ZeRO-1 (planner, docs/planner.md), and a refresh 15.5 GB instead of 129.6.
* Before anything changes, the NaN/Inf check's flag: one all-reduce over the job and one host read
  per step, unless ``nonfinite="ignore"`` (see :class:`~dist_optim.base.DistOptimizer`).

Deviations from galore_torch (all deliberate):

* ``rank`` larger than ``min(M, N)`` raises (galore_torch silently uses ``min(M, N)``).
* ``reverse_std`` on an ``M < N`` matrix with ``rank == M`` back-projects on the side it
  projected (galore_torch picks the side from the low-rank shape and fails with a shape error).
* 8-bit plain-param moments are quantised in blocks of the *full* flattened parameter
  (``dist_optim.states.bnb.FullBlocks``), as on one device: a ZeRO chunk or TP slice holds pieces
  of blocks, whose absmax is max-reduced over its holders (one collective per group and step) and forced on
  bitsandbytes' quantiser, so codes and absmax are the same on every layout. Between the two
  passes this needs, the new moments are recomputed rather than held.
* The projector is kept in the gradient's dtype (as galore_torch) in 32-bit mode; the SVD is done
  in fp32. In 8-bit mode it is *stored* in float16 by default (``projector_dtype``) and widened to
  the gradient's dtype to multiply: with 8-bit moments fp32 projectors would be a fifth of the
  state (the moments shrink 4x, the projectors not at all). Projector entries are entries of
  orthonormal vectors, so |x| <= 1 and fp16 cannot overflow; its rounding (relative 5e-4) keeps the
  8-bit runs within bitsandbytes' own test tolerances of the bitsandbytes-based GaLoreAdamW8bit
  (mean relative parameter error under 1.2e-3: tests/unit/test_galore.py's
  ``test_8bit_matches_bitsandbytes_galore``), where bfloat16's (4e-3) does not. Q-GaLore (Zhang
  et al., 2024, arXiv:2407.08296) goes further with INT4 projectors. ``projector_dtype=torch.float32``
  restores galore_torch's storage.
* An SVD owner's working set for one matrix (its full fp32 gradient, U and V^T of
  ``torch.linalg.svd``) is not split by the budget: ``M N + M k + k N`` fp32 values,
  ``k = min(M, N)``: 2 GiB (2.15 GB) for a Llama-2-70B MLP matrix, 28672 x 8192 (0.94 + 0.94 +
  0.27 GB), the peak transient of a 70B refresh step (the planner's 2.15 GB); only U or V^T is
  used, but computing one without the other would change the numbers galore_torch's SVD gives.
* State is tensors only (``proj_left`` / ``proj_right`` instead of a projector object; low-rank
  moments as ``low_rank_exp_avg`` / ``low_rank_exp_avg_sq``, with ``*_absmax`` in 8-bit mode) so it
  can be checkpointed and does not depend on the layout.

The package, split as :mod:`dist_optim.shampoo` is (math on local tensors apart from who computes
what):

* :mod:`.options`: the option names, defaults and checks (``validate_group``'s, the optimizer-wide
  ones, full shapes);
* :mod:`.geometry`: the rectangles of the full matrix a rank holds, projection sides and shapes;
* :mod:`.state`: what ``optimizer.state`` holds per parameter, one GaLore parameter's step item;
* :mod:`.projection`: SVD projectors, projection and back-projection, local tensors only;
* :mod:`.adamw`: the AdamW moment updates (32-bit, 8-bit, paged, torch's fused kernel), local
  tensors only;
* :mod:`.coordination`: SVD owners, projector partitions, the buckets of partial sums and absmax;
* :mod:`.optimizer`: :class:`DistributedGaLore`, the coordinator;
* :mod:`.groups`: :func:`galore_param_groups`;
* :mod:`.conversions`: conversions from galore_torch / ColossalAI / bitsandbytes GaLore optimizers
  and the planner entry (registered on import).
"""

from . import conversions as conversions  # registers the conversions and the planner entry
from .geometry import Rectangle, low_rank_shape, matrix_pieces, projection_side
from .groups import DEFAULT_TARGETS, galore_param_groups
from .optimizer import DistributedGaLore
from .options import ADAM_STYLES, GROUP_DEFAULTS, PROJ_TYPES

__all__ = [
    "DistributedGaLore",
    "galore_param_groups",
    "matrix_pieces",
    "Rectangle",
    "projection_side",
    "low_rank_shape",
    "PROJ_TYPES",
    "ADAM_STYLES",
    "GROUP_DEFAULTS",
    "DEFAULT_TARGETS",
]
