"""DistributedShampoo with ``kl_statistics=True`` against Meta's KL-Shampoo
(``distributed_shampoo.RootInvKLShampooPreconditionerConfig``, facebookresearch/optimizers), in one
process, in float64: the parameters after several steps, element-wise.

Meta's package is not on PyPI; its current commit imports on this project's torch 2.5.1 from a
checkout on the path (``fetch`` it, or ``git clone https://github.com/facebookresearch/optimizers``)::

    PYTHONPATH=/tmp/optimizers .venv/bin/python bench/kl_shampoo_vs_meta.py [--steps 8]

Both run the same settings: float64 parameters and factors, ``betas=(0, 0.999)`` (Meta's first
moment, and its ``beta3`` filtered gradient, off: the statistics are the point), ``epsilon=1e-10``
added before the root (Meta's ``PerturbationConfig`` default), ``precondition_frequency=2`` from
step 2, bias correction, no grafting, roots by ``eigh``; shapes: a tall and a wide matrix, a 3-D
tensor and a vector; no merging of dims (Meta's default merges a 12 x 7 matrix into one 84-vector:
``target_parameter_dimensionality=inf`` turns that off, ours never merges by default). Printed and
written to ``bench/results/kl_shampoo_vs_meta.json``: for KL-Shampoo and, as the control, plain
Shampoo (Meta's ``RootInvShampooPreconditionerConfig`` against ``kl_statistics=False``), the largest
difference of a parameter from Meta's on its scale (``max |a - b| / max |b|``), and how far
KL-Shampoo's parameters are from Shampoo's (the comparison must separate the two): the loop of
:func:`bench.kl_compare.kl_on_and_off`, written in the table format (``--write``). Meta keeps its
learning rate and its bias correction as float32 scalars (the lr is 2^-7 here, exact in float32; the
bias correction is not), which leaves a residue above float64 rounding in both rows alike.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import dist_optim  # noqa: E402
from bench.kl_compare import COLUMNS, kl_on_and_off  # noqa: E402
from bench.meta_shampoo_conversion import make_params, run  # noqa: E402
from bench.record import present, write_table  # noqa: E402

SHAPES = [(12, 7), (5, 9), (3, 4, 5), (6,)]
#: The first refresh after the factors have full rank (12 statistics steps), then every 2nd step.
START, FREQUENCY = 14, 2
EPSILON = 1e-6
BIAS_CORRECTION = True


def _meta(params: list[torch.nn.Parameter], kl: bool) -> torch.optim.Optimizer:
    import distributed_shampoo as meta

    config = meta.RootInvKLShampooPreconditionerConfig if kl else meta.RootInvShampooPreconditionerConfig
    return meta.DistributedShampoo(
        params,
        lr=2**-7,
        betas=(0.0, 0.999),
        epsilon=EPSILON,
        precondition_frequency=FREQUENCY,
        start_preconditioning_step=START,
        use_bias_correction=BIAS_CORRECTION,
        grafting_config=None,
        preconditioner_config=config(factor_matrix_dtype=torch.float64),
        # Meta merges a tensor's dims up to max_preconditioner_dim by default (a 12 x 7 matrix
        # becomes one 84-vector); ours keeps them (merge_small_dims=False).
        distributed_config=meta.SingleDeviceDistributedConfig(target_parameter_dimensionality=math.inf),
    )


def _ours(params: list[torch.nn.Parameter], kl: bool) -> torch.optim.Optimizer:
    return dist_optim.DistributedShampoo(
        params,
        lr=2**-7,
        betas=(0.0, 0.999),
        epsilon=EPSILON,
        precondition_frequency=FREQUENCY,
        start_preconditioning_step=START,
        use_bias_correction=BIAS_CORRECTION,
        preconditioner_dtype=torch.float64,
        kl_statistics=kl,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--meta-commit", default="", help="the checkout's commit, recorded with the results")
    ap.add_argument(
        "--write", metavar="NAME", default="kl_shampoo_vs_meta", help="bench/results/NAME.json ('': write nothing)"
    )
    a = ap.parse_args(argv)
    try:
        import distributed_shampoo  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"needs Meta's distributed_shampoo on the path ({exc}); see the docstring") from exc
    names = ("KL-Shampoo", "Shampoo (control)", "KL-Shampoo against Shampoo (ours; the matrices and the 3-D tensor)")
    rows = kl_on_and_off(_meta, _ours, lambda: make_params(SHAPES), run, a.steps, names, "Meta's", apart_on=slice(0, 3))
    if a.write:
        extra = {"steps": a.steps, "shapes": SHAPES, "meta_commit": a.meta_commit}
        write_table(a.write, *present(COLUMNS, rows), script=__file__, argv=argv, extra=extra)


if __name__ == "__main__":
    main()
