"""DistributedShampoo with ``eigenvalue_correction=True, kl_statistics=True`` (KL-SOAP) against NVIDIA's
emerging-optimizers SOAP with ``use_kl_shampoo=True``, in one process, in float64: the parameters
after several steps, element-wise.

emerging-optimizers (PyPI ``emerging-optimizers``, pure Python) asks for Python 3.12 but its SOAP
runs on this project's Python 3.11 and torch 2.5.1 given ``typing.override`` (set here from
``typing_extensions``) and no ``torch.compile`` (``TORCHDYNAMO_DISABLE=1``, set here). Unpack the
wheel and put it on the path, nothing installed::

    pip download --no-deps --python-version 3.12 --only-binary=:all: emerging-optimizers -d /tmp/eo
    cd /tmp/eo && unzip -q emerging_optimizers-*.whl
    PYTHONPATH=/tmp/eo .venv/bin/python bench/kl_soap_vs_emerging.py [--steps 20]

Their SOAP casts each gradient to float32 (``p.grad.to(torch.float32)``); this script loads their
module's source with that cast made to the parameter's dtype and seeds their state in float64, so
both run in float64. Their SOAP refreshes its basis at every step, by ``eigh`` at the first and
then (``use_eigh=False``) by one power step from its basis sorted by ``diag(Q^T L Q)``, the second
moment permuted alike: ours runs that, Vyas et al.'s recipe, as ``eigenbasis="qr-eigh-start"``,
``precondition_frequency=1`` from step 1. Both: betas ``(0.9, 0.95)`` (theirs
``shampoo_beta=0.95``: ours uses ``betas[1]`` for the factors too), epsilon 1e-8, bias correction
of the moments and the factors, no weight decay, no grafting (ours then keeps the first moment in
the eigenbasis, as theirs). Their first KL statistics clamp a zero factor's eigenvalues to epsilon;
ours take the identity there
(:func:`dist_optim.shampoo.preconditioner.factors.kl_soap_whiteners`): their factors are seeded
with the identity, which their bias correction replaces by the first statistics whole, so that
both start alike. Shapes: square matrices (theirs refuses other than matrices). Both refresh at
step 1, where a tall or wide matrix's larger factor is singular: its null space's eigenvectors are
LAPACK's choice, which the QR steps and the second moment then carry, so that no two
implementations can agree there (docs/optimizers.md gives how far they part).

Printed and written to ``bench/results/kl_soap_vs_emerging.json``: for KL-SOAP and, as the control,
plain SOAP (theirs with ``use_kl_shampoo=False`` against ``kl_statistics=False``), the largest
difference of a parameter from theirs on its scale (``max |a - b| / max |b|``), and how far KL-SOAP's
parameters are from SOAP's (the comparison must separate the two): the loop of
:func:`bench.kl_compare.kl_on_and_off`, written in the table format (``--write``). A refresh at
every step makes large steps where the basis turns (the second moment is kept per column), which
amplify rounding:
``--noise`` gives the largest difference of ours from itself when its gradients get relative noise
of 1e-15, the floor of the comparison. ``--first-statistics`` shows how long their factors
remember the first gradient when their first statistics clamp a zero factor's eigenvalues to epsilon
(their start) and when they take the identity (ours): :func:`first_statistics_memory`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # their Adam update is a torch.compile'd function

import torch  # noqa: E402
import typing_extensions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import dist_optim  # noqa: E402
from bench.kl_compare import COLUMNS, kl_on_and_off  # noqa: E402
from bench.meta_shampoo_conversion import make_params  # noqa: E402
from bench.record import present, write_table  # noqa: E402

SHAPES: list[tuple[int, ...]] = [(6, 6), (9, 9), (4, 4)]
LR, BETAS, EPSILON = 2**-7, (0.9, 0.95), 1e-8


def _spectrum(d: int, ratio: float, gen: torch.Generator) -> torch.Tensor:
    """``U diag(ratio^(i/2))``: a fixed random rotation scaled by a geometric spectrum."""
    u, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return u * ratio ** (torch.arange(d, dtype=torch.float64) / 2)


def run(
    opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int, noise: float = 0.0
) -> list[torch.Tensor]:
    """``steps`` steps on the same float64 gradients at every call, ``G = A Z B^T`` with ``Z``
    standard normal and ``A A^T``, ``B B^T`` of geometric spectra (ratios 0.5 and 0.6): the
    factors' eigenvalues stay apart. The parameters after. ``noise``: each gradient times ``1 +
    noise * N(0, 1)`` element-wise (its own generator: the gradients are otherwise the same)."""
    gen = torch.Generator().manual_seed(1)
    other = torch.Generator().manual_seed(2)
    sides = [(_spectrum(p.shape[0], 0.5, gen), _spectrum(p.shape[1], 0.6, gen)) for p in params]
    for _ in range(steps):
        for p, (a, b) in zip(params, sides):
            p.grad = a @ torch.randn(p.shape, generator=gen, dtype=p.dtype) @ b.T
            if noise:
                p.grad *= 1 + noise * torch.randn(p.shape, generator=other, dtype=p.dtype)
        opt.step()
    return [p.detach().clone() for p in params]


@functools.cache
def _their_soap() -> Any:
    """Their ``emerging_optimizers.soap.soap`` module, its gradient cast to float32 made to the
    parameter's dtype (the one change to the math), loaded once more from its source."""
    if not hasattr(typing, "override"):  # Python 3.11
        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    spec = importlib.util.find_spec("emerging_optimizers.soap.soap")
    if spec is None or spec.origin is None:
        raise SystemExit("needs emerging-optimizers on the path; see the docstring")
    source = Path(spec.origin).read_text()
    # The cast, and the registration of the class by name (their package registered it on import).
    edits = {"grad = p.grad.to(torch.float32)": "grad = p.grad.to(p.dtype)", '@registry.register_optimizer("soap")': ""}
    for old, new in edits.items():
        if source.count(old) != 1:
            raise SystemExit(f"their SOAP no longer has {old!r}: update this script")
        source = source.replace(old, new)
    module = types.ModuleType(spec.name)
    module.__file__ = spec.origin
    exec(compile(source, spec.origin, "exec"), module.__dict__)
    return module


def _theirs(params: list[torch.nn.Parameter], kl: bool) -> torch.optim.Optimizer:
    soap = _their_soap()
    opt = soap.SOAP(
        params, lr=LR, betas=BETAS, shampoo_beta=BETAS[1], eps=EPSILON, weight_decay=0.0,
        use_eigh=False, power_iter_steps=1, use_kl_shampoo=kl, correct_bias=True,
    )  # fmt: skip
    for p in params:  # float64 state; factors seeded with I (their first lerp weight is 1)
        eye = [torch.eye(d, dtype=p.dtype) for d in p.shape]
        opt.state[p].update(
            step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), L=eye[0].clone(), R=eye[1].clone(),
            Q_L=eye[0].clone(), Q_R=eye[1].clone(),
        )  # fmt: skip
    return opt


def _ours(params: list[torch.nn.Parameter], kl: bool) -> torch.optim.Optimizer:
    return dist_optim.DistributedShampoo(
        params,
        lr=LR,
        betas=BETAS,
        epsilon=EPSILON,
        eigenvalue_correction=True,
        eigenbasis="qr-eigh-start",
        precondition_frequency=1,
        start_preconditioning_step=1,
        preconditioner_dtype=torch.float64,
        kl_statistics=kl,
    )


def first_statistics_memory(steps: int = 400) -> dict[str, list[tuple[int, float]]]:
    """How long their left factor remembers the first gradient, started as theirs (a zero factor,
    its eigenvalues clamped to epsilon at the first statistics) and as ours (the identity): two
    runs of their KL-SOAP on an 8 x 6 matrix whose standard normal gradients differ at the first
    step only, ``||L_a / ||L_a|| - L_b / ||L_b|| ||_F`` at some steps."""
    soap = _their_soap()

    def factors(first_seed: int, seeded: bool) -> list[torch.Tensor]:
        p = torch.nn.Parameter(torch.zeros(8, 6, dtype=torch.float64))
        opt = soap.SOAP(
            [p], lr=1e-3, betas=BETAS, shampoo_beta=BETAS[1], eps=EPSILON, weight_decay=0.0, use_eigh=True,
            use_kl_shampoo=True,
        )  # fmt: skip
        start = torch.eye if seeded else (lambda d, dtype: torch.zeros(d, d, dtype=dtype))
        eye = [torch.eye(d, dtype=p.dtype) for d in p.shape]
        opt.state[p].update(
            step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), L=start(8, dtype=p.dtype),
            R=start(6, dtype=p.dtype), Q_L=eye[0], Q_R=eye[1],
        )  # fmt: skip
        first, rest = torch.Generator().manual_seed(first_seed), torch.Generator().manual_seed(5)
        out = []
        for t in range(steps):
            p.grad = torch.randn(8, 6, generator=first if t == 0 else rest, dtype=p.dtype)
            opt.step()
            out.append(opt.state[p]["L"] / opt.state[p]["L"].norm())
        return out

    marks = [t for t in (1, 5, 20, 50, 100, 200, 300, 399) if t < steps]
    rows = {}
    for name, seeded in (("theirs (epsilon)", False), ("ours (identity)", True)):
        a, b = factors(11, seeded), factors(12, seeded)
        rows[name] = [(t + 1, float((a[t] - b[t]).norm())) for t in marks]
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--noise", action="store_true", help="also ours against ours on noisy gradients")
    ap.add_argument(
        "--first-statistics", action="store_true", help="also how long their factor remembers the first gradient"
    )
    ap.add_argument(
        "--write", metavar="NAME", default="kl_soap_vs_emerging", help="bench/results/NAME.json ('': write nothing)"
    )
    a = ap.parse_args(argv)
    import emerging_optimizers

    names = ("KL-SOAP", "SOAP (control)", "KL-SOAP against SOAP (ours)")
    rows = kl_on_and_off(
        _theirs, _ours, lambda: make_params(SHAPES), run, a.steps, names, "emerging-optimizers'", noise=a.noise
    )
    extra: dict[str, Any] = {"steps": a.steps, "shapes": SHAPES, "emerging_optimizers": emerging_optimizers.__version__}
    if a.first_statistics:
        memory = first_statistics_memory()
        extra["first_statistics_memory"] = memory
        for name, marks in memory.items():
            print(f"first gradient's mark on their normalised L, started as {name}: "
                  + ", ".join(f"step {t}: {v:.2g}" for t, v in marks))  # fmt: skip
    if a.write:
        write_table(a.write, *present(COLUMNS, rows), script=__file__, argv=argv, extra=extra)


if __name__ == "__main__":
    main()
