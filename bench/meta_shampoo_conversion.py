"""``dist_optim.convert`` of Meta's ``DistributedShampoo`` (facebookresearch/optimizers, its current
option classes) stepped beside Meta's own, in one process, in float64.

Meta's package is not on PyPI; its current commit imports on this project's torch 2.5.1 from a
checkout on the path::

    PYTHONPATH=/tmp/optimizers .venv/bin/python bench/meta_shampoo_conversion.py [--steps 16]

Each configuration is built twice with Meta's class: one is stepped as it is, the other converted
and stepped as ours, on the same float64 parameters (a 12 x 7 and a 5 x 9 matrix, a 3 x 4 x 5 tensor,
a 6-vector and a 40 x 3 matrix) and gradients; lr 2^-7 (exact in Meta's float32 lr tensor), epsilon
1e-6, weight decay 0.01, the first root or basis at step 14 (the factors of the unmerged tensors
have full rank by then), then every 2nd step. Printed and written to
``bench/results/meta_shampoo_conversion.json``: for each configuration, each parameter's largest
difference from Meta's on its scale (``max |a - b| / max |b|``). Meta keeps its lr and bias
corrections as float32 scalars, which leaves a residue above float64 rounding. SOAP's two bases
differ in more than speed: Meta's ``eigh`` one keeps ``eigh``'s increasing column order, which SOAP's
second moment (kept in the basis's coordinates across refreshes) depends on, so it converts to
``eigenbasis="eigh-ascending"``, not to Vyas et al.'s decreasing ``"eigh"``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import dist_optim  # noqa: E402
from bench.record import col, write_table  # noqa: E402

SHAPES = [(12, 7), (5, 9), (3, 4, 5), (6,), (40, 3)]


def make_params(shapes: list[tuple[int, ...]] = SHAPES) -> list[torch.nn.Parameter]:
    """float64 parameters of ``shapes``, the same at every call."""
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in shapes]


def run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int) -> list[torch.Tensor]:
    """``steps`` steps on the same random float64 gradients at every call; the parameters after them."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()
    return [p.detach().clone() for p in params]


def configurations(m: Any) -> dict[str, dict[str, Any]]:
    """Meta's constructor options of each configuration (``m``: Meta's package)."""
    f64 = torch.float64
    no_merge = m.SingleDeviceDistributedConfig(target_parameter_dimensionality=math.inf)
    return {
        # KL-Shampoo with Adam grafting, Meta's default merging of dims (a 12 x 7 matrix is one
        # 84-vector) and packed factors.
        "KL-Shampoo, Adam grafting, merged dims": dict(
            preconditioner_config=m.RootInvKLShampooPreconditionerConfig(
                factor_matrix_dtype=f64, inv_factor_matrix_dtype=f64
            ),
            grafting_config=m.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
        ),
        # Shampoo in blocks of at most 16, merged dims, L2 weight decay.
        "Shampoo, blocks of 16, L2 decay": dict(
            preconditioner_config=m.RootInvShampooPreconditionerConfig(
                factor_matrix_dtype=f64, inv_factor_matrix_dtype=f64
            ),
            max_preconditioner_dim=16,
            weight_decay_type=m.WeightDecayType.L2,
        ),
        # Meta's DefaultSOAPConfig (one QR step per refresh), dims kept (merged vectors of 84 and
        # 120 would have rank-deficient factors, whose eigenbasis no run pins down).
        "SOAP (DefaultSOAPConfig), dims kept": dict(
            preconditioner_config=m.EigenvalueCorrectedShampooPreconditionerConfig(
                amortized_computation_config=m.QREigendecompositionConfig(),
                factor_matrix_dtype=f64,
                factor_matrix_eigenvectors_dtype=f64,
                corrected_eigenvalues_dtype=f64,
            ),
            betas=(0.9, 0.95),
            distributed_config=no_merge,
        ),
        # Meta's eigh basis, recomputed at every refresh, dims kept.
        "SOAP (EighEigendecompositionConfig), dims kept": dict(
            preconditioner_config=m.EigenvalueCorrectedShampooPreconditionerConfig(
                factor_matrix_dtype=f64, factor_matrix_eigenvectors_dtype=f64, corrected_eigenvalues_dtype=f64
            ),
            betas=(0.9, 0.95),
            distributed_config=no_merge,
        ),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--meta-commit", default="", help="the checkout's commit, recorded with the results")
    ap.add_argument(
        "--write", metavar="NAME", default="meta_shampoo_conversion", help="bench/results/NAME.json ('': write nothing)"
    )
    a = ap.parse_args(argv)
    try:
        import distributed_shampoo as m
    except ImportError as exc:
        raise SystemExit(f"needs Meta's distributed_shampoo on the path ({exc}); see the docstring") from exc
    common = dict(lr=2**-7, betas=(0.9, 0.999), epsilon=1e-6, precondition_frequency=2, start_preconditioning_step=14)
    rows = []
    for name, options in configurations(m).items():
        kwargs = {**common, "weight_decay": 0.01, **options}
        theirs = run(m.DistributedShampoo(ps := make_params(), **kwargs), ps, a.steps)
        ours = run(dist_optim.convert(m.DistributedShampoo(qs := make_params(), **kwargs)), qs, a.steps)
        diffs = [float((x - y).abs().max() / y.abs().max()) for x, y in zip(ours, theirs)]
        rows.append({"configuration": name, **{f"p{i}": d for i, d in enumerate(diffs)}})
        print(f"{name}: " + ", ".join(f"{s}: {d:.1e}" for s, d in zip(SHAPES, diffs)))
    if a.write:
        columns = [col("configuration", "configuration")]
        columns += [col(f"p{i}", " x ".join(map(str, s)), 1, format="e") for i, s in enumerate(SHAPES)]
        extra = {"steps": a.steps, "shapes": SHAPES, "meta_commit": a.meta_commit}
        notes = ["Each parameter's largest difference from Meta's on its scale, max |a - b| / max |b|."]
        write_table(a.write, columns, rows, notes, script=__file__, argv=argv, extra=extra)


if __name__ == "__main__":
    main()
