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
maps (the format of bitsandbytes' own 8-bit blockwise Adam; :mod:`dist_optim.bnb_states`). Each
step dequantises, updates in fp32, takes the step from the fp32 values and re-quantises, as
bitsandbytes' kernel does. Like bitsandbytes, moments with fewer than ``min_8bit_size`` elements
stay fp32. ``is_paged`` allocates moments of >= 1e5 elements in bitsandbytes' paged (CUDA
unified) memory; on CPU it warns and uses ordinary tensors.

Distributed (TP slices, ZeRO chunks, both): every quantity the algorithm reads is of the full
matrix.

* Refresh steps: each SVD has one owner rank in the matrix's work group (the TP x
  ZeRO/data-parallel grid of the ranks that hold it, :mod:`dist_optim.owners`; owners balanced by
  the SVDs' cost, planned once with the routes of the gradient's pieces). Bucket by bucket
  (``bucket_bytes`` of full gradients, :mod:`dist_optim.budget`), every rank sends its pieces of
  the bucket's gradients straight to their owners (``owners.to_owners``: one all-to-all per work
  group), each owner computes its SVDs on the whole matrices it assembled, and the projectors go to
  every rank of the work group (``owners.share_results``: one all-gather per work group); the full
  gradients are dropped before the next bucket. No rank holds a full gradient it does not own.
  Where the pieces do not tile a matrix (no route), that matrix is gathered whole as a fallback.
* Every step: the projection is a sum over the projected dim. Each rank multiplies the pieces of
  ``G`` it holds (a TP slice, or the <= 3 rectangles a flat ZeRO chunk covers: a partial first row,
  whole rows, a partial last row) with the matching rows/cols of the projector, adds them into a
  zero low-rank tensor of the full shape, and the partial sums of a bucket (``bucket_bytes`` of
  low-rank gradients) are added over the holders in rank order
  (:class:`~dist_optim.comm.OrderedSumBucket`: a reduce-scatter as one all-to-all, then an
  all-gather, per group), so that the result is bit-identical whatever the budget. The low-rank
  moments are then the same full tensors on every rank (replicated, layout-independent state),
  and the back-projection gives each rank exactly its own elements. No full gradient is gathered
  between refreshes.
* Before anything changes, the NaN/Inf check's flag: one all-reduce over the job and one host read
  per step, unless ``nonfinite="ignore"`` (see :class:`~dist_optim.base.DistOptimizer`).

Deviations from galore_torch (all deliberate):

* ``rank`` larger than ``min(M, N)`` raises (galore_torch silently uses ``min(M, N)``).
* ``reverse_std`` on an ``M < N`` matrix with ``rank == M`` back-projects on the side it
  projected (galore_torch picks the side from the low-rank shape and fails with a shape error).
* 8-bit plain-param moments are quantised in blocks of the *full* flattened parameter
  (``bnb_states.FullBlocks``), as on one device: a ZeRO chunk or TP slice holds pieces of blocks, whose absmax
  is max-reduced over its holders (one collective per group and step) and forced on
  bitsandbytes' quantiser, so codes and absmax are the same on every layout. Between the two
  passes this needs, the new moments are recomputed rather than held.
* The projector is kept in the gradient's dtype (as galore_torch) in 32-bit mode; the SVD is done
  in fp32. In 8-bit mode it is *stored* in float16 by default (``projector_dtype``) and widened to
  the gradient's dtype to multiply: with 8-bit moments fp32 projectors would be a fifth of the
  state (the moments shrink 4x, the projectors not at all). Projector entries are entries of
  orthonormal vectors, so |x| <= 1 and fp16 cannot overflow; its rounding (relative 5e-4) keeps the
  8-bit runs within bitsandbytes' own test tolerances of the bitsandbytes-based GaLoreAdamW8bit
  (mean relative parameter error 6e-5 against the 1.2e-3 allowed, tested), where bfloat16's
  (4e-3) does not (2.1e-3). Q-GaLore (Zhang et al., 2024, arXiv:2407.08296) goes further with
  INT4 projectors. ``projector_dtype=torch.float32`` restores galore_torch's storage.
* The low-rank moments and projectors are still whole on every rank of a matrix's work group
  (issue 27 item 2 asks for them partitioned as ZeRO partitions full moments: not done yet), so
  GaLore's state per rank is far above the ideal at many ranks; ``bucket_bytes`` bounds only the
  step's transient memory. An SVD owner's working set for one matrix (its full fp32 gradient, U
  and V^T of ``torch.linalg.svd``) is not split by the budget: ``M N + M k + k N`` fp32 values,
  ``k = min(M, N)`` (2.1 GB for a Llama-2-70B MLP matrix, 28672 x 8192).
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
* :mod:`.coordination`: SVD owners, sharing projectors, the buckets of partial sums and absmax;
* :mod:`.optimizer`: :class:`DistributedGaLore`, the coordinator;
* :mod:`.groups`: :func:`galore_param_groups`;
* :mod:`.conversions`: conversions from galore_torch / ColossalAI / bitsandbytes GaLore optimizers
  and the planner entry (registered on import).
"""

from . import conversions as conversions  # registers the conversions and the planner entry
from .geometry import Piece, low_rank_shape, matrix_pieces, projection_side
from .groups import DEFAULT_TARGETS, galore_param_groups
from .optimizer import DistributedGaLore
from .options import ADAM_STYLES, GROUP_DEFAULTS, PROJ_TYPES

__all__ = [
    "DistributedGaLore",
    "galore_param_groups",
    "matrix_pieces",
    "Piece",
    "projection_side",
    "low_rank_shape",
    "PROJ_TYPES",
    "ADAM_STYLES",
    "GROUP_DEFAULTS",
    "DEFAULT_TARGETS",
]
