r"""Optimizer configurations the generic tests run: every public optimizer must appear here.

Adding an optimizer: one :class:`Family` (the booster columns, the checkpoint tests and the
README's support-table row derive from :data:`FAMILIES`) and its :class:`Case`\ s of the parity
grid (:data:`PARITY_CASES`, and :data:`PRODUCTION_CASES` where large blocks take other kernels)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import dist_optim
from dist_optim.muon.heavyball import HEAVYBALL_NS_COEFFICIENTS


@dataclass(frozen=True)
class Family:
    """One optimizer as the booster and checkpoint tests run it.

    ``name`` is its row of the README's support table; ``booster`` and ``checkpoint`` are what a
    user passes to ``booster.boost``: the ordinary optimizer's class path and options (ours for
    Shampoo and Muon, which have no ordinary class on the pinned torch). The plugins must swap it
    for ``cls``."""

    name: str
    cls: type
    booster: tuple[str, dict[str, Any]]
    checkpoint: tuple[str, dict[str, Any]]


_PER_HEAD = dict(adamw_lr=1e-3, per_head=True)
_AUX_ONLY = dict(adamw_lr=1e-3)

FAMILIES: list[Family] = [
    Family(
        "LAMB",
        dist_optim.DistributedLamb,
        booster=("colossalai.nn.optimizer.Lamb", dict(lr=1e-2, weight_decay=1e-2, bias_correction=True)),
        checkpoint=("colossalai.nn.optimizer.Lamb", dict(lr=1e-2, weight_decay=1e-2)),
    ),
    Family(
        "Adafactor",
        dist_optim.DistributedAdafactor,
        booster=("transformers.optimization.Adafactor", dict(beta1=0.9, weight_decay=1e-2)),
        checkpoint=(
            "transformers.optimization.Adafactor",
            dict(lr=1e-2, relative_step=False, scale_parameter=False, beta1=0.9),
        ),
    ),
    # CAME moves every weight by ~lr per step whatever its scale: at lr=1e-2 the tiny Llama's
    # weights (~0.02) move by half their size per step, and at lr >= 1e-3 its trajectory amplifies
    # 1-ulp differences of gradient averaging (see test_adafactor_came.py); at 1e-4 the run is tame.
    Family(
        "CAME",
        dist_optim.DistributedCAME,
        booster=("colossalai.nn.optimizer.CAME", dict(lr=1e-4, weight_decay=1e-2)),
        checkpoint=("came_pytorch.CAME", dict(lr=1e-4)),
    ),
    # GaLore: one projector refresh (step 1: full-gradient gathers, owner SVDs, shared projectors),
    # which a checkpoint must restore, not recompute. A second refresh is hypersensitive to
    # rounding in GaLore itself: on ONE process, gradients times (1 + 1e-6 noise) change the 5-step
    # updates by ~40% once a second refresh happens (Adam moments carried across a refresh meet
    # singular vectors whose signs/order changed).
    Family(
        "GaLore",
        dist_optim.DistributedGaLore,
        booster=(
            "galore_torch.GaLoreAdamW",
            dict(lr=1e-3, eps=1e-3, galore=dict(rank=8, update_proj_gap=100, scale=0.25), weight_decay=0.0),
        ),
        checkpoint=(
            "galore_torch.GaLoreAdamW",
            dict(lr=1e-3, eps=1e-3, galore=dict(rank=8, update_proj_gap=100, scale=0.25)),
        ),
    ),
    # Shampoo: passed as ours. epsilon=1e-4: with 1e-8, 1e-7 relative gradient noise on ONE process
    # moves the embedding by ~2% in 5 steps; with 1e-4 by ~4e-6. Checkpoints: per-block factors,
    # roots and grafting state held by owner ranks.
    Family(
        "Shampoo",
        dist_optim.DistributedShampoo,
        booster=(
            "dist_optim.DistributedShampoo",
            dict(
                lr=1e-2,
                epsilon=1e-4,
                max_preconditioner_dim=64,
                precondition_frequency=2,
                grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8),
            ),
        ),
        checkpoint=(
            "dist_optim.DistributedShampoo",
            dict(
                lr=1e-3,
                epsilon=1e-4,
                max_preconditioner_dim=64,
                precondition_frequency=2,
                momentum=0.5,
                grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8),
            ),
        ),
    ),
    # Kron checkpoints: owner-held preconditioner factors, random generators and update counters.
    Family(
        "Kron",
        dist_optim.DistributedKron,
        booster=("kron_torch.Kron", dict(lr=3e-3, weight_decay=1e-2)),
        checkpoint=("kron_torch.Kron", dict(lr=3e-3, weight_decay=1e-2)),
    ),
    # Muon: passed as ours (the pinned torch has no torch.optim.Muon), with the usual split of the
    # model (dist_optim.muon_param_groups): hidden matrices orthogonalized on their owner ranks,
    # embeddings, LM head and norms in its AdamW group. Checkpoints: momentum in each rank's pieces,
    # AdamW moments and step counters of the auxiliary groups.
    Family(
        "Muon",
        dist_optim.DistributedMuon,
        booster=("dist_optim.DistributedMuon", dict(lr=2e-3, weight_decay=1e-2, muon=dict(adamw_lr=1e-3))),
        checkpoint=("dist_optim.DistributedMuon", dict(lr=2e-3, weight_decay=1e-2, muon=dict(adamw_lr=1e-3))),
    ),
    # Per-head Muon (muon_param_groups(per_head=True)): q, k and v by their 4 heads each, whole in
    # every TP slice at tp=2, so orthogonalized where they are; the other matrices as Muon's.
    Family(
        "Muon per-head",
        dist_optim.DistributedMuon,
        booster=("dist_optim.DistributedMuon", dict(lr=2e-3, weight_decay=1e-2, muon=_PER_HEAD)),
        checkpoint=("dist_optim.DistributedMuon", dict(lr=2e-3, weight_decay=1e-2, muon=_PER_HEAD)),
    ),
    # Muon with QK-clip (MuonClip, Kimi K2): the tiny models' largest logits start near 0.1, so a
    # bound of 0.07 clips some heads' q and k rows at every step; each TP rank measures and clips
    # its own heads, the maxima max-reduced over the data-parallel ranks.
    Family(
        "Muon QK-clip",
        dist_optim.DistributedMuon,
        booster=("dist_optim.DistributedMuon", dict(lr=2e-3, weight_decay=1e-2, qk_clip_tau=0.07, muon=_AUX_ONLY)),
        checkpoint=("dist_optim.DistributedMuon", dict(lr=2e-3, weight_decay=1e-2, qk_clip_tau=0.07, muon=_AUX_ONLY)),
    ),
    # KL-Shampoo (kl_statistics=True): the factors' statistics from the gradient preconditioned by
    # the current roots, on each block's owner; Shampoo's settings otherwise.
    Family(
        "KL-Shampoo",
        dist_optim.DistributedShampoo,
        booster=(
            "dist_optim.DistributedShampoo",
            dict(
                lr=1e-2,
                epsilon=1e-4,
                max_preconditioner_dim=64,
                precondition_frequency=2,
                kl_statistics=True,
                grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8),
            ),
        ),
        checkpoint=(
            "dist_optim.DistributedShampoo",
            dict(
                lr=1e-3,
                epsilon=1e-4,
                max_preconditioner_dim=64,
                precondition_frequency=2,
                momentum=0.5,
                kl_statistics=True,
                grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8),
            ),
        ),
    ),
    # KL-SOAP (eigenvalue_correction=True with kl_statistics=True): SOAP whose factors' statistics
    # are whitened by the other factors' inverses in SOAP's basis, on each block's owner; epsilon as
    # Shampoo's row. The booster with Shampoo's Adam grafting: without it, at lr=1e-2 and 5e-3 its
    # larger early steps made the fp16 column's gradients overflow at 2 of the 5 steps (skipped by
    # the loss scaler, so not every step reached the optimizer), and at 3e-3 a norm weight of the
    # bf16 tp=2 columns moved 1.335x the single process's end to end (MOVED_RANGE). Checkpoints
    # without grafting: the first moment kept in the eigenbasis (exp_avg_eigen) is saved and resharded.
    Family(
        "KL-SOAP",
        dist_optim.DistributedShampoo,
        booster=(
            "dist_optim.DistributedShampoo",
            dict(
                lr=1e-2,
                epsilon=1e-4,
                max_preconditioner_dim=64,
                precondition_frequency=2,
                eigenvalue_correction=True,
                kl_statistics=True,
                grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8),
            ),
        ),
        checkpoint=(
            "dist_optim.DistributedShampoo",
            dict(
                lr=1e-3,
                epsilon=1e-4,
                max_preconditioner_dim=64,
                precondition_frequency=2,
                momentum=0.5,
                eigenvalue_correction=True,
                kl_statistics=True,
            ),
        ),
    ),
    # NorMuon, per head: q, k and v by their 4 heads, each head's rows normalized by the owner of
    # its TP slice; the other matrices' rows by their owners of the TP x DP grid.
    Family(
        "NorMuon",
        dist_optim.DistributedNorMuon,
        booster=("dist_optim.DistributedNorMuon", dict(lr=2e-3, weight_decay=1e-2, muon=_PER_HEAD)),
        checkpoint=("dist_optim.DistributedNorMuon", dict(lr=2e-3, weight_decay=1e-2, muon=_PER_HEAD)),
    ),
]


@dataclass(frozen=True)
class Case:
    id: str
    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: The support-table row it backs, where not the first family of its class.
    row: str | None = None


PARITY_CASES: list[Case] = [
    Case("lamb", dist_optim.DistributedLamb, dict(lr=1e-2, weight_decay=1e-2)),
    Case("lamb-nobc-clamp", dist_optim.DistributedLamb, dict(lr=2e-2, bias_correction=False, clamp_value=0.8)),
    Case("lamb-foreach", dist_optim.DistributedLamb, dict(lr=1e-2, weight_decay=1e-2, foreach=True)),
    # 8-bit moments on every tensor of the grid (min_8bit_size=0): blocks of the full tensor cut by
    # TP slices and ZeRO chunks, their absmax max-reduced over the holders; codes compared as state.
    # A step budget of a few parameters: every rank must cut the same buckets, also where flat
    # ranges give the ranks pieces of different sizes.
    Case(
        "lamb-8bit",
        dist_optim.DistributedLamb,
        dict(lr=1e-2, weight_decay=1e-2, optim_bits=8, min_8bit_size=0, bucket_bytes=600),
    ),
]

# DistributedShampoo: blocks of 3 cut every test param of the grid into several blocks.
PARITY_CASES += [
    Case(
        "shampoo-adam-eigh-blocks-pf2",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2,
            epsilon=1e-6,
            max_preconditioner_dim=3,
            precondition_frequency=2,
            weight_decay=1e-2,
            momentum=0.5,
            grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8),
        ),
    ),
    Case(
        "shampoo-soap-qr",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2,
            epsilon=1e-8,
            max_preconditioner_dim=4,
            precondition_frequency=2,
            eigenvalue_correction=True,
            eigenbasis="qr",
            weight_decay=1e-2,
            use_decoupled_weight_decay=False,
        ),
    ),
    # The warm-started refresh: a tolerance some refreshes meet and some do not, QR steps, the kept
    # eigenvectors in the state (Shampoo's basis<k>), S permuted with the sorted columns (SOAP).
    Case(
        "shampoo-warm",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2,
            epsilon=1e-6,
            max_preconditioner_dim=3,
            precondition_frequency=2,
            root_inverse="warm",
            refresh_tolerance=0.05,
            refresh_iterations=2,
            grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8),
        ),
    ),
    Case(
        "soap-warm",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2,
            epsilon=1e-8,
            max_preconditioner_dim=4,
            precondition_frequency=2,
            eigenvalue_correction=True,
            eigenbasis="warm",
            refresh_tolerance=0.05,
            refresh_iterations=2,
        ),
    ),
    # Factors and roots (SOAP: factors) as packed triangles, gathered and resharded in that form.
    Case(
        "shampoo-packed",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2,
            epsilon=1e-6,
            max_preconditioner_dim=3,
            precondition_frequency=2,
            use_symmetric_packing=True,
            grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8),
        ),
    ),
    Case(
        "soap-packed",
        dist_optim.DistributedShampoo,
        dict(lr=1e-2, epsilon=1e-8, max_preconditioner_dim=4, eigenvalue_correction=True, use_symmetric_packing=True),
    ),
    # KL-Shampoo's statistics, made by each block's owner from its whole block gradient and its
    # current roots (refreshed every 2nd step from step 2), packed factors and roots.
    Case(
        "shampoo-kl",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2,
            epsilon=1e-6,
            max_preconditioner_dim=4,
            precondition_frequency=2,
            start_preconditioning_step=2,
            use_symmetric_packing=True,
            kl_statistics=True,
            grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8),
        ),
        row="KL-Shampoo",
    ),
    # KL-SOAP's statistics, whitened by the other factors' inverses in the block's basis (the
    # eigenvalues estimated there from its factors), on each block's owner; packed factors and
    # 8-bit moments (the first in the eigenbasis, the second) of every block beside them.
    Case(
        "soap-kl",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2,
            epsilon=1e-8,
            max_preconditioner_dim=4,
            precondition_frequency=2,
            eigenvalue_correction=True,
            kl_statistics=True,
            use_symmetric_packing=True,
            optim_bits=8,
            min_8bit_size=0,
        ),
        row="KL-SOAP",
    ),
    # heavyball's SOAP/KL-SOAP as dist_optim.convert makes it (tests/unit/test_heavyball_soap.py):
    # the first step seeds, Adam in the previous step's bases, then the statistics (einsum products)
    # and the lifted QR refresh on each block's owner, every step counted by the optimizer (the
    # "row" param's missing step included); KL statistics on the matrix blocks, vectors with a factor.
    Case(
        "soap-heavyball",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2,
            betas=(0.9, 0.95),
            shampoo_beta=0.9,
            epsilon=1e-8,
            weight_decay=1e-2,
            max_preconditioner_dim=4,
            precondition_frequency=3,
            eigenvalue_correction=True,
            eigenbasis="qr-lifted",
            soap_step="heavyball",
            kl_statistics=True,
            merge_small_dims="trailing",
            precondition_1d=True,
        ),
    ),
    # 8-bit moments and grafting state of every block (min_8bit_size=0): quantised on the owner,
    # blocks of the Shampoo block's own elements; codes and absmax gathered as state.
    Case(
        "shampoo-8bit",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2,
            epsilon=1e-6,
            max_preconditioner_dim=3,
            precondition_frequency=2,
            momentum=0.5,
            optim_bits=8,
            min_8bit_size=0,
            grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8),
        ),
    ),
    Case(
        "soap-8bit",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2, epsilon=1e-8, max_preconditioner_dim=4, eigenvalue_correction=True, optim_bits=8, min_8bit_size=0
        ),
    ),
    # Quantised eigenvectors (preconditioner_bits=4): codes, absmax and Shampoo's spectra made by
    # the owner from its whole block, gathered as state; packed factors beside them in SOAP's case.
    Case(
        "shampoo-4bit",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2,
            epsilon=1e-6,
            max_preconditioner_dim=3,
            precondition_frequency=2,
            preconditioner_bits=4,
            grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8),
        ),
    ),
    Case(
        "soap-4bit",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2,
            epsilon=1e-8,
            max_preconditioner_dim=4,
            eigenvalue_correction=True,
            use_symmetric_packing=True,
            preconditioner_bits=4,
        ),
    ),
    Case(
        "shampoo-newton-sgd-merge",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2,
            epsilon=1e-4,
            root_inverse="coupled_newton",
            merge_small_dims=True,
            # "conv" (3, 4, 3) merges to (12, 3): under TP its slices are no boxes of that view, so
            # its full gradient is gathered while the others' pieces go to their block owners.
            max_preconditioner_dim=12,
            start_preconditioning_step=1,
            grafting_config=dist_optim.SGDGraftingConfig(),
            momentum=0.9,
            use_nesterov=True,
            bucket_bytes=200,  # bound: full gradients gathered a few parameters at a time
        ),
    ),
]

# DistributedAdafactor / DistributedCAME: factored statistics of the full matrix under every layout.
PARITY_CASES += [
    Case("adafactor-relative", dist_optim.DistributedAdafactor, dict()),
    Case(
        "adafactor-lr-beta1-wd-clip",
        dist_optim.DistributedAdafactor,
        dict(lr=1e-2, relative_step=False, beta1=0.9, weight_decay=1e-2, clip_threshold=0.5),
    ),
    Case(
        "adafactor-noscale-warmup",
        dist_optim.DistributedAdafactor,
        dict(scale_parameter=False, warmup_init=True, decay_rate=-0.5),
    ),
    Case("adafactor-torch", dist_optim.DistributedAdafactor, dict(variant="torch", lr=2e-2, weight_decay=1e-2)),
    Case("came", dist_optim.DistributedCAME, dict(lr=1e-2, weight_decay=1e-2)),
    Case(
        "came-betas-clip",
        dist_optim.DistributedCAME,
        dict(lr=2e-2, betas=(0.8, 0.9, 0.95), clip_threshold=0.5, eps=(1e-20, 1e-12)),
    ),
    # 8-bit first moment on every tensor (min_8bit_size=0); the factored statistics stay fp32.
    Case("came-8bit", dist_optim.DistributedCAME, dict(lr=1e-2, weight_decay=1e-2, optim_bits=8, min_8bit_size=0)),
]

# DistributedGaLore: GaLore options on the 2-D params (tests/helpers/parity.py MATRIX_GROUP), the 3-D
# "conv" and the vectors get plain AdamW. Rank 2 <= every matrix's min dim; a gap of 2 refreshes
# the projectors at steps 0, 2, 4 (the "row" param, which skips a step, at its own counts).
# reverse_std projects "col" over its TP-split rows and "row" over its TP-split columns: the
# shapes where ColossalAI's DistGaloreAwamW crashes. "full" uses eps=1e-3: right after a refresh
# the off-diagonal entries of P^T G Q^T are rounding noise (~1e-7), and Adam with a tiny eps
# normalises noise to O(1), so any change of summation order would show. The 8-bit case passes at
# 1e-5 because no moment lands within rounding distance of a quantisation code boundary here;
# quantisation is discontinuous, so a change in these inputs could legitimately flip a code.
_GALORE = dict(rank=2, update_proj_gap=2, scale=0.5)
PARITY_CASES += [
    Case(
        "galore-std",
        dist_optim.DistributedGaLore,
        dict(lr=1e-2, weight_decay=1e-2, _matrix_group=dict(_GALORE, proj_type="std")),
    ),
    Case(
        "galore-reverse_std-nobc",
        dist_optim.DistributedGaLore,
        dict(lr=1e-2, correct_bias=False, _matrix_group=dict(_GALORE, proj_type="reverse_std")),
    ),
    Case(
        "galore-full-bnb",
        dist_optim.DistributedGaLore,
        dict(lr=1e-2, eps=1e-3, weight_decay=1e-2, adam_style="bnb", _matrix_group=dict(_GALORE, proj_type="full")),
    ),
    Case(
        "galore-left-8bit",
        dist_optim.DistributedGaLore,
        dict(lr=1e-2, optim_bits=8, min_8bit_size=0, _matrix_group=dict(_GALORE, proj_type="left")),
    ),
]

# DistributedKron: preconditioners of the full tensors on owner ranks. Default (probability 1 for
# the grid's 6 steps, triangular factors, "conv" merged to 12x3); one_diag with weight decay and the
# initial scale from each parameter's first gradient (on its owner); a constant probability 0.5
# (updates every 2nd step), all-diagonal factors fitted to the raw grad.
PARITY_CASES += [
    Case("kron", dist_optim.DistributedKron, dict(lr=1e-2)),
    Case(
        "kron-one_diag-wd-init",
        dist_optim.DistributedKron,
        dict(lr=1e-2, weight_decay=1e-2, memory_save_mode="one_diag", precond_init_scale=None),
    ),
    Case(
        "kron-p0.5-all_diag-grad",
        dist_optim.DistributedKron,
        dict(
            lr=2e-2,
            preconditioner_update_probability=0.5,
            memory_save_mode="all_diag",
            momentum_into_precond_update=False,
            seed=7,
        ),
    ),
    # heavyball's PSGDKron as dist_optim.convert makes it (tests/unit/test_heavyball_psgd.py): the
    # bias-corrected average counted in optimizer steps, the running-sum schedule (p=0.4: updates at
    # steps 3 and 5), dampened noise, balancing, lower-bounded factor steps (kept as state on the
    # owners), trust-region clip, weight decay on every tensor, unit dims dropped, initial scale power 0.5.
    Case(
        "kron-heavyball",
        dist_optim.DistributedKron,
        dict(
            lr=1e-2,
            weight_decay=1e-2,
            variant="heavyball",
            preconditioner_update_probability=0.4,
            precond_init_scale=None,
            precond_init_scale_power=0.5,
        ),
    ),
    # 8-bit momentum on every tensor of the grid (min_8bit_size=0): updated on the holders, blocks of
    # the full tensor cut by TP slices and ZeRO chunks, their absmax max-reduced over the holders;
    # codes compared as state, the factors stay fp32.
    Case("kron-8bit", dist_optim.DistributedKron, dict(lr=1e-2, weight_decay=1e-2, optim_bits=8, min_8bit_size=0)),
    # Triangular factors as packed upper triangles on their owners (smart_one_diag: diagonal ones too),
    # gathered and resharded in that form.
    Case(
        "kron-packed",
        dist_optim.DistributedKron,
        dict(lr=1e-2, weight_decay=1e-2, memory_save_mode="smart_one_diag", use_symmetric_packing=True),
    ),
    # Triangular factors as 8-bit codes of their packed triangles (preconditioner_bits=8) on their
    # owners, quantised anew on the owner at each update: codes and absmax compared as state,
    # gathered and resharded in that form; the diagonal factors stay fp32.
    Case(
        "kron-lowbit",
        dist_optim.DistributedKron,
        dict(
            lr=1e-2,
            weight_decay=1e-2,
            memory_save_mode="smart_one_diag",
            use_symmetric_packing=True,
            preconditioner_bits=8,
        ),
    ),
]

# Production-size factors under distribution (tests/helpers/parity.py PRODUCTION_SPECS: dims 300-576, above
# dist_optim.kernels.structured.MIN_SIZE, so the blocked triangle and Gram kernels run on the owners) on
# tp=2 x dp=2 x ZeRO and dp=4 x ZeRO.
PRODUCTION_CASES: list[Case] = [
    Case(
        "shampoo-production-blocks",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2,
            epsilon=1e-6,
            max_preconditioner_dim=1024,
            precondition_frequency=2,
            start_preconditioning_step=2,
            momentum=0.5,
            grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8),
        ),
    ),
    Case(
        "soap-qr-production-blocks",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2,
            epsilon=1e-8,
            max_preconditioner_dim=1024,
            precondition_frequency=2,
            eigenvalue_correction=True,
            eigenbasis="qr",
            weight_decay=1e-2,
        ),
    ),
    # KL-SOAP: its eigenvalues read each large factor's kept triangle, mirrored on the owner.
    Case(
        "soap-kl-production-blocks",
        dist_optim.DistributedShampoo,
        dict(
            lr=1e-2,
            epsilon=1e-8,
            max_preconditioner_dim=1024,
            precondition_frequency=2,
            eigenvalue_correction=True,
            eigenbasis="qr",
            kl_statistics=True,
        ),
    ),
    Case("kron-production", dist_optim.DistributedKron, dict(lr=1e-2, weight_decay=1e-2)),
]

# DistributedMuon: every matrix (the 3-D "conv" as 3 x 12) orthogonalized whole on its owner rank of
# the TP x DP grid, pieces routed there and back; the vectors in an AdamW group (use_muon=False).
# The second case: torch's/KellerJordan's EMA momentum and additive eps without Nesterov, a
# 3-iteration coefficient schedule, Moonlight's lr adjustment on the 2-D matrices only, and the
# 3-D "conv" as a stack of matrices (stacked=True).
_AUX = dict(use_muon=False, weight_decay=0.0)
PARITY_CASES += [
    Case("muon", dist_optim.DistributedMuon, dict(lr=2e-2, weight_decay=1e-2, _vector_group=_AUX)),
    # 8-bit momentum on every matrix of the grid and 8-bit AdamW moments on the vectors
    # (min_8bit_size=0): blocks of the full tensor cut by TP slices and ZeRO chunks, their absmax
    # max-reduced over the holders; codes compared as state. A budget of a few parameters per bucket.
    Case(
        "muon-8bit",
        dist_optim.DistributedMuon,
        dict(lr=2e-2, weight_decay=1e-2, optim_bits=8, min_8bit_size=0, bucket_bytes=100, _vector_group=_AUX),
    ),
    Case(
        "muon-ema-schedule-rms",
        dist_optim.DistributedMuon,
        dict(
            lr=1e-2,
            nesterov=False,
            momentum=0.9,
            momentum_ema=True,
            eps_form="add",
            stacked=True,  # the 3-D "conv" as 3 matrices 4 x 3, each on its own owner
            ns_coefficients=[(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037)],
            adamw_betas=(0.8, 0.99),
            _matrix_group=dict(adjust_lr_fn="match_rms_adamw"),
            _vector_group=dict(_AUX, weight_decay=1e-2),
        ),
    ),
    # heavyball's Muon as dist_optim.convert makes it (tests/unit/test_heavyball.py): the gradient
    # plus its average (nesterov_sum) and heavyball's five-triple schedule.
    Case(
        "muon-heavyball",
        dist_optim.DistributedMuon,
        dict(
            lr=2e-2,
            weight_decay=1e-2,
            momentum=0.9,
            momentum_ema=True,
            nesterov_sum=True,
            ns_coefficients=list(HEAVYBALL_NS_COEFFICIENTS),
            adjust_lr_fn="original",
            _vector_group=_AUX,
        ),
    ),
    # Per-head Muon: "col" (8 rows, 4 heads of 2) keeps whole heads in its TP slices at tp=2 and 4
    # (each rank orthogonalizes its own); "emb" (12 rows, 6 heads) at tp=2 (3 heads a rank), not at
    # tp=4 (6 heads over 4 slices: its heads go to owners of the TP x DP grid); "row" (split by
    # columns under TP) and "padrep" (5 heads of one row) never.
    Case(
        "muon-heads",
        dist_optim.DistributedMuon,
        dict(
            lr=2e-2,
            weight_decay=1e-2,
            _per_param={"col": dict(heads=4), "emb": dict(heads=6), "row": dict(heads=2), "padrep": dict(heads=5)},
            _vector_group=_AUX,
        ),
        row="Muon per-head",
    ),
    # NorMuon: the owner of each matrix (each head of "col" and "emb", as muon-heads) normalizes its
    # rows and keeps their second moment; the second case with 8-bit momentum, the EMA form, and the
    # 3-D "conv" as a stack of 3 matrices (a second moment of 3 x 4 rows).
    Case(
        "normuon",
        dist_optim.DistributedNorMuon,
        dict(
            lr=2e-2,
            weight_decay=1e-2,
            _per_param={"col": dict(heads=4), "emb": dict(heads=6)},
            _vector_group=_AUX,
        ),
    ),
    # QK-clip: "col" is attention a's q_proj (4 heads of 2 rows) and "bias" its k_proj's bias (each
    # head's rows times gamma^0.4 and gamma^0.6); "emb" is attention b's q_proj, 4 heads of 3 rows
    # sharing 2 key heads (times gamma). TP slices hold whole heads at tp=2 and 4; the logits are
    # tests/helpers/parity.py's GridLogits, each head's maximum on one data-parallel rank.
    Case(
        "muon-qk-clip",
        dist_optim.DistributedMuon,
        dict(
            lr=2e-2,
            weight_decay=1e-2,
            qk_clip_tau=1.0,
            qk_clip_alpha=0.4,
            _vector_group=_AUX,
            _qk_clip={"col": ("a", "q", 2, 1), "bias": ("a", "k", 2, 1), "emb": ("b", "q", 3, 2)},
        ),
        row="Muon QK-clip",
    ),
    Case(
        "normuon-8bit-stacked",
        dist_optim.DistributedNorMuon,
        dict(
            lr=2e-2,
            beta2=0.9,
            momentum_ema=True,
            stacked=True,
            optim_bits=8,
            min_8bit_size=0,
            _vector_group=_AUX,
        ),
    ),
]
