"""Our SOAP, Muon and PSGD Kron against heavyball's compiled ones, in one process (issue 31).

heavyball (PyPI) compiles its steps with ``torch.compile`` and needs torch >= 2.9, above the
torch 2.5.1 that ColossalAI 0.5.0 pins, so this runs in a scratch virtual environment with our
package on the path (it imports without ColossalAI)::

    python3.11 -m venv /tmp/hb && /tmp/hb/bin/pip install "torch>=2.9" heavyball numpy
    PYTHONPATH=. /tmp/hb/bin/python bench/vs_heavyball.py [--repeats 30] [--only soap muon kron]

The set: ``bench_step.llama_like(512, 1376, 2, vocab)``, 7.4M parameters with the default
``--vocab 2048`` (every dim at most 2048: heavyball leaves a dim above ``max_precond_dim``
unpreconditioned where ours cuts it into blocks, which would not be the same math). Every optimizer
steps its own copy with fixed gradients; steps are timed round-robin (one step of each optimizer in
turn), after ``--warmup`` rounds that include heavyball's compilation and each optimizer's first
preconditioner. Printed per pair: the median step of each (a step between refreshes) and the mean
over the timed rounds (with the refreshes), and ours / theirs.

* SOAP: Vyas et al.'s recipe on both sides (eigenvectors at the first refresh, then one QR power
  step from the current basis: ours ``eigenbasis="qr-eigh-start"``), betas (0.9, 0.95), the factors'
  beta 0.95, epsilon 1e-8, decoupled weight decay 0.01, ``precondition_frequency`` 10 (heavyball's
  schedule off), 1-D parameters preconditioned, no dim merging, fp32 states.
* Muon: the 2-D parameters, momentum 0.95 with Nesterov, 5 Newton-Schulz steps; ours in bf16
  (``ns_dtype=torch.bfloat16``) and with its default fp32 iteration, heavyball's in its own dtype.
* Kron: the preconditioner updated every step on both sides (probability 1), triangular factors
  up to 2048, no dim merging; the rest each package's default (they differ in details, e.g.
  heavyball's cached and delayed preconditioner: its figure is for orientation, not a parity).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.bench_step import fixed_params, llama_like  # noqa: E402

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def soap_pair() -> list[tuple[str, Factory]]:
    import heavyball

    import dist_optim

    common = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    return [
        (
            "ours SOAP",
            lambda ps: dist_optim.DistributedShampoo(
                ps,
                epsilon=1e-8,
                eigenvalue_correction=True,
                eigenbasis="qr-eigh-start",
                precondition_frequency=10,
                max_preconditioner_dim=2048,
                **common,
            ),
        ),
        (
            "heavyball SOAP",
            lambda ps: heavyball.SOAP(
                ps,
                shampoo_beta=0.95,
                eps=1e-8,
                precondition_frequency=10,
                max_precond_dim=2048,
                merge_dims=False,
                precondition_1d=True,
                use_precond_schedule=False,
                **common,
            ),
        ),
    ]


def muon_pair() -> list[tuple[str, Factory]]:
    import heavyball

    import dist_optim

    return [
        ("ours Muon bf16", lambda ps: dist_optim.DistributedMuon(ps, lr=0.02, ns_dtype=torch.bfloat16)),
        ("ours Muon fp32 (default)", lambda ps: dist_optim.DistributedMuon(ps, lr=0.02)),
        ("heavyball Muon", lambda ps: heavyball.Muon(ps, lr=0.02, betas=(0.95, 0.95), nesterov=True)),
    ]


def kron_pair() -> list[tuple[str, Factory]]:
    import heavyball

    import dist_optim

    return [
        (
            "ours Kron",
            lambda ps: dist_optim.DistributedKron(
                ps, lr=3e-4, preconditioner_update_probability=1.0, max_size_triangular=2048, merge_dims=False
            ),
        ),
        (
            "heavyball PSGDKron",
            lambda ps: heavyball.PSGDKron(
                ps, lr=3e-4, preconditioner_update_probability=1.0, max_size_triangular=2048, merge_dims=False
            ),
        ),
    ]


PAIRS = {"soap": soap_pair, "muon": muon_pair, "kron": kron_pair}


def run(name: str, shapes: list[tuple[int, ...]], warmup: int, repeats: int) -> list[tuple[str, float, float]]:
    """(label, median ms, mean ms) of each optimizer of the pair, timed round-robin."""
    if name == "muon":
        shapes = [s for s in shapes if len(s) == 2]
    make = fixed_params(shapes)
    grads = [p.grad.clone() for p in make()]  # type: ignore[union-attr]
    runs = []
    for label, factory in PAIRS[name]():
        params = make()
        runs.append((label, factory(params), params, []))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ours unbound: single-process use warns once
        for i in range(warmup + repeats):
            for _label, opt, params, times in runs:
                for p, g in zip(params, grads):  # heavyball's step consumes .grad
                    p.grad = g.clone()
                gc.collect()
                t0 = time.perf_counter()
                opt.step()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
    return [(label, 1e3 * statistics.median(t), 1e3 * statistics.mean(t)) for label, _opt, _params, t in runs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=sorted(PAIRS), default=["soap", "muon", "kron"])
    ap.add_argument("--warmup", type=int, default=12, help="untimed rounds (compilation, first refresh)")
    ap.add_argument("--repeats", type=int, default=30, help="timed rounds (pf=10: 3 refreshes in 30)")
    ap.add_argument("--vocab", type=int, default=2048)
    args = ap.parse_args()
    from importlib.metadata import version

    shapes = llama_like(512, 1376, 2, args.vocab)
    n = sum(torch.Size(s).numel() for s in shapes)
    print(f"torch {torch.__version__}, heavyball {version('heavyball')}, {n / 1e6:.1f}M parameters")
    print(f"threads {torch.get_num_threads()}, warmup {args.warmup}, timed rounds {args.repeats}")
    for name in args.only:
        rows = run(name, shapes, args.warmup, args.repeats)
        theirs = rows[-1]
        print(f"\n{name}: median ms (between refreshes), mean ms (with refreshes), ours / heavyball")
        for label, median, mean in rows:
            ratio = "" if label == theirs[0] else f"   {median / theirs[1]:.2f}x median, {mean / theirs[2]:.2f}x mean"
            print(f"  {label:26s} {median:8.1f} {mean:8.1f}{ratio}")


if __name__ == "__main__":
    main()
